"""Load a model for serving: ``--model`` value -> weights on a device, config, tokenizer, identity.

Accepted values (see :func:`inference_worker.registry.resolve_model`):

* a built-in name (``gemma-3-270m``, ``smollm2-135m-instruct``, optionally ``@bf16``): prepared once into the
  model cache (:mod:`inference_worker.model.prepare`), then loaded from safetensors;
* an HF directory (``config.json``, ``*.safetensors``, ``tokenizer.json``), e.g. a prepared directory;
* a ``.gguf`` file: read and dequantized in memory ("cold" load); its tokenizer needs transformers.

Serving from a prepared or HF directory needs only torch, safetensors and tokenizers. When an expected
``sha256`` is given, the weights are hashed and compared before anything is loaded.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from inference_worker.config import ModelConfig
from inference_worker.model.gguf_weights import iter_gguf_state_dict
from inference_worker.model.prepare import prepare_model, read_manifest, weights_sha256
from inference_worker.model.transformer import CausalLM
from inference_worker.registry import resolve_model

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsHashMismatch(ValueError):
    """The weights' sha256 differs from the expected one; the model is not served."""


@dataclass
class LoadedModel:
    """A model ready to run: weights, config and tokenizer as loaded from disk (the engine is built from it;
    the worker server wraps the running engine as :class:`inference_worker.server.state.ServedModel`).

    Attributes:
        name: display name (artifact name or file/directory name).
        path: directory or GGUF file the weights came from.
        config: the architecture.
        model: the module, in eval mode on ``device`` in ``dtype``.
        tokenizer: ``tokenizers.Tokenizer`` (None only when loading a GGUF with ``load_tokenizer=False``).
        sha256: weights hash (manifest value, or computed when verified; None if neither).
        eos_token_ids: ids that end generation (config eos + chat end-of-turn).
        load_seconds: wall time of the load.
    """

    name: str
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    sha256: str | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    load_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def default_dtype(device: torch.device | str) -> str:
    """fp32 on CPU, bf16 on CUDA (the project default)."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def verify_sha256(path: str | Path, expected: str) -> str:
    """Hash the weights at ``path`` and compare with ``expected`` (case-insensitive hex).

    Raises:
        WeightsHashMismatch: the hashes differ; the message names both.
    """
    actual = weights_sha256(path)
    if actual.lower() != expected.strip().lower():
        raise WeightsHashMismatch(
            f"refusing to load {path}: weights sha256 mismatch: expected {expected.strip().lower()}, got {actual}"
        )
    return actual


def load_model(model: str | Path, *, dtype: str | None = None, device: str | torch.device = "cpu",
               sha256: str | None = None, load_tokenizer: bool = True) -> LoadedModel:
    """Load ``model`` (built-in name, HF directory or ``.gguf`` path) for inference.

    Args:
        dtype: compute dtype (``float32``/``bfloat16``/``float16``); default fp32 on CPU, bf16 on CUDA. A built-in
            name with ``@bf16`` selects the bf16 artifact.
        device: torch device.
        sha256: expected weights hash; verified before loading.
        load_tokenizer: for a ``.gguf`` path, convert its tokenizer with transformers (slow; prepare instead).

    Raises:
        WeightsHashMismatch: ``sha256`` given and different.
        ValueError: unknown model, unsupported architecture, or weights that do not fit the config.
        FileNotFoundError: missing files.
    """
    started = time.monotonic()
    device = torch.device(device)
    spec = resolve_model(str(model), None)
    dtype = dtype or spec.dtype or default_dtype(device)
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    torch_dtype = TORCH_DTYPES[dtype]
    if spec.kind == "gguf":
        loaded = _load_gguf(spec.path, torch_dtype, device, sha256, load_tokenizer)
    else:
        directory = spec.path
        if spec.kind == "builtin":
            directory = prepare_model(spec.name if spec.dtype is None else str(model)).path
        loaded = _load_dir(directory, torch_dtype, device, sha256)
    loaded.load_seconds = time.monotonic() - started
    return loaded


def _build(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if not _is_tied_head(k, config)}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"weights do not fit {config.architecture} config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.eval()


def _is_tied_head(name: str, config: ModelConfig) -> bool:
    return config.tie_word_embeddings and name == "lm_head.weight"


def _eos_ids(config: ModelConfig, directory: Path | None) -> tuple[int, ...]:
    ids = list(config.eos_token_ids)
    gen_path = directory / "generation_config.json" if directory else None
    if gen_path is not None and gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _load_dir(directory: Path, dtype: torch.dtype, device: torch.device, sha256: str | None) -> LoadedModel:
    manifest = read_manifest(directory) or {}
    digest = verify_sha256(directory, sha256) if sha256 else manifest.get("sha256")
    config = ModelConfig.from_path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    model = _build(config, state, dtype, device)
    tok_path = directory / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}; prepare the model first")
    return LoadedModel(manifest.get("name") or directory.name, directory, config, model,
                       Tokenizer.from_file(str(tok_path)), digest, _eos_ids(config, directory), dtype, device)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, sha256: str | None,
               load_tokenizer: bool) -> LoadedModel:
    digest = verify_sha256(path, sha256) if sha256 else None
    config = ModelConfig.from_gguf(path)
    model = _build(config, dict(iter_gguf_state_dict(path, config)), dtype, device)
    tokenizer = None
    if load_tokenizer:
        from transformers import AutoTokenizer  # cold path only; prepared models need no transformers

        hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = hf_tok.backend_tokenizer
    eos = list(config.eos_token_ids)
    if tokenizer is not None:
        from inference_worker.tokenization import end_of_turn_token_ids

        eos += end_of_turn_token_ids(tokenizer)
    return LoadedModel(path.stem, path, config, model, tokenizer, digest, tuple(dict.fromkeys(eos)), dtype, device)
