"""``models prepare``: turn a GGUF model into a cached HF-style directory that serving loads in seconds.

A prepared model directory (``$FERRY_MODEL_CACHE/<name>`` or ``<name>@bf16``) holds:

* ``model.safetensors`` - dequantized weights with HF names, in the artifact's dtype;
* ``config.json`` - :meth:`ModelConfig.to_hf_config` (transformers can load the directory too);
* ``tokenizer.json``, ``tokenizer_config.json`` (+ ``chat_template.jinja`` when the GGUF has one) -
  written by transformers' GGUF tokenizer conversion, the only place transformers is used;
* ``generation_config.json`` - bos/eos/pad ids, eos including the chat end-of-turn token;
* ``ferry_model.json`` - the manifest: source GGUF (path, size, mtime), dtype, weights sha256.

Preparing is idempotent: when the manifest matches the source and dtype, nothing is recomputed (a stat
and a JSON read; torch is not even imported). The directory is written under a temporary name and renamed, so a crash never
leaves a half-written model that looks prepared.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from inference_worker.config import DTYPES, ModelConfig
from inference_worker.registry import ModelSpec, model_cache_dir, resolve_model

MANIFEST = "ferry_model.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class PreparedModel:
    """A prepared model directory and its identity."""

    name: str
    """Artifact name, e.g. ``gemma-3-270m`` or ``gemma-3-270m@bf16``."""
    path: Path
    """The directory."""
    sha256: str
    """sha256 of the weights (see :func:`weights_sha256`)."""
    dtype: str
    """Weight dtype of the artifact."""
    created: bool
    """True when this call wrote the directory, False when it was already prepared."""


def weights_sha256(path: str | Path) -> str:
    """sha256 (hex) identifying a model's weights.

    A file (``.gguf`` or ``.safetensors``): the file's sha256. A directory: the sha256 of the bytes of
    its ``*.safetensors`` files concatenated in name order (a single-file model hashes the same as the file).

    Raises:
        FileNotFoundError: no weights at ``path``.
    """
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no weights (.gguf or *.safetensors) at {p}")
    digest = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(8 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory: str | Path) -> dict | None:
    """The manifest of a prepared directory, or None when it is missing or unreadable."""
    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def prepare_model(model: str, *, dtype: str | None = None, cache_dir: str | Path | None = None,
                  force: bool = False) -> PreparedModel:
    """Prepare a built-in model name (``gemma-3-270m``, ``gemma-3-270m@bf16``) or a ``.gguf`` path.

    Args:
        model: built-in name (optional ``@bf16``/``@fp16``/``@fp32`` suffix) or path to a GGUF file.
        dtype: weight dtype of the artifact (overrides the suffix); default float32.
        cache_dir: root directory (default ``$FERRY_MODEL_CACHE`` or ``~/.cache/ferry/models``).
        force: rebuild even if a matching prepared directory exists.

    Raises:
        ValueError: not a built-in name or GGUF file, or an unsupported GGUF architecture.
    """
    spec = resolve_model(model, dtype)
    if spec.kind == "hf_dir":
        raise ValueError(f"{model!r} is already an HF directory; it needs no preparation")
    dtype = spec.dtype or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    target = root / spec.artifact_name
    source = _source_identity(spec)
    manifest = read_manifest(target)
    if (not force and manifest and manifest.get("source") == source and manifest.get("dtype") == dtype
            and manifest.get("version") == MANIFEST_VERSION and (target / WEIGHTS_FILE).is_file()):
        return PreparedModel(spec.artifact_name, target, manifest["sha256"], dtype, created=False)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.artifact_name}.", dir=root))
    os.chmod(tmp, 0o755)
    try:
        sha = _write_artifact(spec, tmp, dtype, source, _sibling_with_tokenizer(root, source))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PreparedModel(spec.artifact_name, target, sha, dtype, created=True)


def _source_identity(spec: ModelSpec) -> dict:
    stat = spec.path.stat()
    return {"path": str(spec.path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _sibling_with_tokenizer(root: Path, source: dict) -> Path | None:
    """Another prepared artifact (e.g. the fp32 one when preparing bf16) of the same source, to copy its tokenizer."""
    for candidate in sorted(root.iterdir()) if root.is_dir() else []:
        manifest = read_manifest(candidate)
        if manifest and manifest.get("source") == source and (candidate / "tokenizer.json").is_file():
            return candidate
    return None


def _write_artifact(spec: ModelSpec, out: Path, dtype: str, source: dict, sibling: Path | None) -> str:
    import torch  # heavy imports only when there is work to do: an up-to-date prepare stays torch-free
    from safetensors.torch import save_file

    from inference_worker.model.gguf_weights import iter_gguf_state_dict

    started = time.monotonic()
    config = ModelConfig.from_gguf(spec.path)
    torch_dtype = getattr(torch, dtype)
    state = {name: t.to(torch_dtype) for name, t in iter_gguf_state_dict(spec.path, config)}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "source": spec.path.name})
    del state
    tokenizer_eos = _write_tokenizer(spec.path, out, sibling)
    eos_ids = list(dict.fromkeys([*config.eos_token_ids, *tokenizer_eos]))
    hf_config = config.to_hf_config()
    hf_config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos_ids, "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    sha = weights_sha256(out / WEIGHTS_FILE)
    manifest = {
        "version": MANIFEST_VERSION, "name": spec.artifact_name, "source": source, "dtype": dtype,
        "sha256": sha, "architecture": config.architecture, "prepare_seconds": round(time.monotonic() - started, 3),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return sha


def _write_tokenizer(gguf_file: Path, out: Path, sibling: Path | None) -> list[int]:
    """Convert the GGUF tokenizer with transformers (or copy a sibling's conversion); return end-of-turn ids."""
    from inference_worker.tokenization import end_of_turn_token_ids, load_tokenizer

    if sibling is not None:
        for name in TOKENIZER_FILES:
            if (sibling / name).is_file():
                shutil.copy2(sibling / name, out / name)
    else:
        from transformers import AutoTokenizer  # prepare-time only dependency

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        tokenizer.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise RuntimeError(f"transformers did not write tokenizer.json for {gguf_file}")
    return end_of_turn_token_ids(load_tokenizer(out))
