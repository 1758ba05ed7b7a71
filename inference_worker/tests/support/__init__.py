"""Test-only helpers, never imported when serving: prepared real models (:mod:`.models`), a worker
subprocess (:mod:`.worker`) and an agent subprocess (:mod:`.agent`). The apps' tests and ``bench/`` use
them too."""
