"""Ferry's inference worker: ``python -m inference_worker serve | router | agent | models``.

Packages and modules from the bottom; each imports only those above it (measured with ``ast`` when
written: keep it so, or update this list):

- ``config`` (torch-free: architecture, HF/GGUF config parsing, KV accounting), ``registry``,
  ``tokenization``, ``metrics``, ``http_headers`` (the ``X-Ferry-*`` header names): no Ferry imports;
- ``model`` (transformer, loaders) -> config, registry, tokenization; ``kernels`` -> nothing;
- ``kv_transfer`` -> config, metrics;
- ``engine`` -> config, kernels, kv_transfer, model, tokenization;
- ``server`` -> engine, kv_transfer, model, metrics, http_headers, tokenization;
  ``router`` -> kv_transfer, http_headers, tokenization; ``agent`` -> nothing;
- ``cli`` -> the above.

Test-only helpers live in ``inference_worker/tests/support`` and are never imported when serving.
This module imports nothing, so torch-free users of :mod:`inference_worker.config` stay torch-free.
"""
