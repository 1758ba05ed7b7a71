"""Model architecture and KV accounting, torch-free: the one parser of HF ``config.json`` and GGUF metadata.

The Django control plane (``apps/catalog``) and the worker's loaders and model import this package; it
imports neither torch nor :mod:`inference_worker.model` (a test checks both), so the dependency runs one
way: ``model`` -> ``config``.

Modules:

- :mod:`.architecture`: attention-type names, dtypes, the architectures' ``layer_types`` rule and the
  KV accounting formula (``kv_bytes``, ``kv_bytes_per_token``);
- :mod:`.model_config`: :class:`ModelConfig`, the validated architecture dataclass;
- :mod:`.hf`: translation between ``ModelConfig`` and HF ``config.json`` dicts (both RoPE spellings);
- :mod:`.gguf`: ``ModelConfig`` fields from GGUF metadata;
- :mod:`.gguf_header`: a fast reader of a GGUF file's header (metadata and tensor infos, no tensor data).

Every public name is re-exported here, so ``from inference_worker.config import ModelConfig`` works.
"""

from inference_worker.config.architecture import (
    DTYPE_BYTES,
    DTYPES,
    FULL_ATTENTION,
    GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ,
    GEMMA3_SLIDING_WINDOW_PATTERN,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    derive_layer_types,
    kv_bytes,
    kv_bytes_per_token,
)
from inference_worker.config.gguf import gguf_config_kwargs, read_gguf_metadata
from inference_worker.config.gguf_header import GGUFHeader, GGUFTensorInfo, read_gguf_header
from inference_worker.config.hf import hf_rope_parameters, model_config_to_hf
from inference_worker.config.model_config import ModelConfig

__all__ = [
    "DTYPES",
    "DTYPE_BYTES",
    "FULL_ATTENTION",
    "GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ",
    "GEMMA3_SLIDING_WINDOW_PATTERN",
    "GGUFHeader",
    "GGUFTensorInfo",
    "LAYER_TYPES",
    "SLIDING_ATTENTION",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "derive_layer_types",
    "gguf_config_kwargs",
    "hf_rope_parameters",
    "kv_bytes",
    "kv_bytes_per_token",
    "model_config_to_hf",
    "read_gguf_header",
    "read_gguf_metadata",
]
