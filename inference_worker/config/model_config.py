"""``ModelConfig``: the architecture of a decoder-only transformer, parsed from HF or GGUF (torch-free).

This is the one place in Ferry that parses a model's architecture: from an HF ``config.json``
(``ModelConfig.from_hf_config`` / ``from_path`` on a directory) or from GGUF metadata
(``ModelConfig.from_gguf``). The Django control plane imports it (it must never import torch),
and so do the worker's loaders and model. The KV accounting formula is in :mod:`.architecture`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inference_worker.config.architecture import (
    DTYPES,
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    derive_layer_types,
    kv_bytes,
    kv_bytes_per_token,
    require_positive_int,
)
from inference_worker.config.gguf import gguf_config_kwargs
from inference_worker.config.hf import hf_rope_parameters, model_config_to_hf

_HF_MODEL_TYPES = {"gemma3_text": "gemma3", "gemma3": "gemma3", "llama": "llama"}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer with per-layer attention type.

    Fields follow HF ``config.json`` names. Construct with the ``from_*`` class methods; the
    constructor validates and raises ``ValueError`` on inconsistent values.
    """

    architecture: str
    """``"gemma3"`` or ``"llama"``."""
    num_hidden_layers: int
    """Number of decoder layers."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """MLP inner width."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (GQA: ``num_attention_heads`` is a multiple of it)."""
    head_dim: int
    """Width of one attention head."""
    vocab_size: int
    """Rows of the embedding / logits width."""
    max_position_embeddings: int
    """Maximum context length in tokens."""
    layer_types: tuple[str, ...]
    """Per layer: ``"sliding_attention"`` or ``"full_attention"``."""
    sliding_window: int | None
    """Window W in tokens of sliding layers (query i sees keys i-W < j <= i); None if no sliding layer."""
    rope_theta: float
    """RoPE base of full-attention layers (and of all layers for Llama)."""
    rope_local_base_freq: float | None
    """RoPE base of sliding layers (Gemma 3); None means ``rope_theta``."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    dtype: str
    """Weight dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    tie_word_embeddings: bool
    """Output projection shares the embedding matrix."""
    hidden_activation: str = "silu"
    """MLP activation in HF naming: ``"silu"`` or ``"gelu_pytorch_tanh"``."""
    query_pre_attn_scalar: float | None = None
    """Gemma: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (None: ``head_dim ** -0.5``)."""
    rope_scaling_factor: float = 1.0
    """Linear RoPE scaling of full-attention layers (positions divided by it; Gemma 3 >= 1B uses 8)."""
    attn_logit_softcapping: float | None = None
    """Gemma 2 style tanh soft-cap of attention scores (None: off)."""
    final_logit_softcapping: float | None = None
    """tanh soft-cap of output logits (None: off)."""
    attention_bias: bool = False
    """q/k/v/o projections have a bias."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that end generation."""
    pad_token_id: int | None = None
    """Padding token id."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            require_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}; expected {LAYER_TYPES}")
        if SLIDING_ATTENTION in self.layer_types:
            if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
                raise ValueError(f"sliding layers need a positive integer sliding_window, got {self.sliding_window!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.rope_theta <= 0 or (self.rope_local_base_freq is not None and self.rope_local_base_freq <= 0):
            raise ValueError("rope_theta and rope_local_base_freq must be positive")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"rope_scaling_factor must be positive, got {self.rope_scaling_factor}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.hidden_activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_activation {self.hidden_activation!r}")

    # ----------------------------------------------------------------- derived
    @property
    def num_full_layers(self) -> int:
        """Number of full-attention layers."""
        return self.layer_types.count(FULL_ATTENTION)

    @property
    def num_sliding_layers(self) -> int:
        """Number of sliding-window layers."""
        return self.layer_types.count(SLIDING_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        """True when the model mixes sliding and full attention layers."""
        return 0 < self.num_sliding_layers < self.num_hidden_layers

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Window of layer ``layer_idx`` in tokens, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    def rope_base(self, layer_type: str) -> float:
        """RoPE base frequency for a layer type (Gemma 3 sliding layers use ``rope_local_base_freq``)."""
        _check_layer_type(layer_type)
        if layer_type == SLIDING_ATTENTION and self.rope_local_base_freq is not None:
            return self.rope_local_base_freq
        return self.rope_theta

    def rope_scaling(self, layer_type: str) -> float:
        """Linear RoPE position-scaling factor for a layer type (1.0 = none; only full layers scale)."""
        _check_layer_type(layer_type)
        return self.rope_scaling_factor if layer_type == FULL_ATTENTION else 1.0

    def kv_bytes_per_token(self, layer_type: str, dtype_bytes: int = 2) -> int:
        """K+V bytes per token in one layer of ``layer_type`` (same for both types; validated)."""
        _check_layer_type(layer_type)
        return kv_bytes_per_token(num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
                                  dtype_bytes=dtype_bytes)

    def kv_bytes(self, num_tokens: int, *, hybrid: bool = True, dtype_bytes: int = 2) -> int:
        """KV bytes for ``num_tokens`` tokens; see the module-level :func:`kv_bytes`."""
        return kv_bytes(
            num_tokens,
            num_full_layers=self.num_full_layers,
            num_sliding_layers=self.num_sliding_layers,
            sliding_window=self.sliding_window,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            dtype_bytes=dtype_bytes,
            hybrid=hybrid,
        )

    # --------------------------------------------------------------- parsing
    @classmethod
    def from_hf_config(cls, data: dict[str, Any]) -> ModelConfig:
        """Parse an HF ``config.json`` dict (``gemma3_text``, ``gemma3`` with ``text_config``, ``llama``).

        Reads ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_local_base_freq``/``rope_scaling``
        (transformers 4). Raises ``ValueError`` for an unsupported ``model_type`` or RoPE type.
        """
        if not isinstance(data, dict):
            raise ValueError(f"config must be a dict, got {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type == "gemma3" and isinstance(data.get("text_config"), dict):
            data = {**data["text_config"], "model_type": "gemma3_text",
                    **{k: data[k] for k in ("eos_token_id", "bos_token_id") if k in data}}
            model_type = "gemma3_text"
        architecture = _HF_MODEL_TYPES.get(model_type or "")
        if architecture is None:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_HF_MODEL_TYPES))}"
            )
        try:
            num_layers = int(data["num_hidden_layers"])
            hidden = int(data["hidden_size"])
            heads = int(data["num_attention_heads"])
        except KeyError as exc:
            raise ValueError(f"config.json is missing {exc.args[0]!r}") from exc
        head_dim = int(data.get("head_dim") or hidden // heads)
        gemma = architecture == "gemma3"
        sliding_window = data.get("sliding_window")
        layer_types = data.get("layer_types") or derive_layer_types(architecture, num_layers, sliding_window)
        if SLIDING_ATTENTION not in layer_types:
            sliding_window = None
        rope_theta, rope_local, scaling = hf_rope_parameters(data, gemma)
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        dtype = data.get("dtype") or data.get("torch_dtype") or ("bfloat16" if gemma else "float32")
        return cls(
            architecture=architecture,
            num_hidden_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(heads if data.get("num_key_value_heads") is None else data["num_key_value_heads"]),
            head_dim=head_dim,
            vocab_size=int(data["vocab_size"]),
            max_position_embeddings=int(data.get("max_position_embeddings") or 2048),
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
            rope_theta=rope_theta,
            rope_local_base_freq=rope_local,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            dtype=str(dtype),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", gemma)),
            hidden_activation=str(data.get("hidden_activation") or data.get("hidden_act") or
                                  ("gelu_pytorch_tanh" if gemma else "silu")),
            query_pre_attn_scalar=float(data.get("query_pre_attn_scalar", head_dim)) if gemma else None,
            rope_scaling_factor=scaling,
            attn_logit_softcapping=data.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=data.get("final_logit_softcapping") if gemma else None,
            attention_bias=bool(data.get("attention_bias", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=data.get("pad_token_id"),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> ModelConfig:
        """Parse GGUF metadata (``gemma3`` or ``llama``); weights are described as dequantized ``float32``.

        GGUF has no ``layer_types``; they are derived by :func:`derive_layer_types`. Gemma 3 GGUF lacks the
        sliding-layer RoPE base, so :data:`GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ` (1e4) is used.

        Raises:
            ValueError: the file is not GGUF, or its ``general.architecture`` is unsupported (named).
            FileNotFoundError: the path does not exist.
        """
        return cls(**gguf_config_kwargs(path))

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """Parse a directory holding ``config.json``, a ``config.json`` file, or a ``.gguf`` file.

        Raises:
            FileNotFoundError: nothing usable at ``path``.
            ValueError: unparseable or unsupported config.
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise FileNotFoundError(f"no model config at {p}")
        if p.suffix == ".gguf":
            return cls.from_gguf(p)
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p} is not valid JSON: {exc}") from exc
        return cls.from_hf_config(data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (tuples become lists), plus the derived layer counts."""
        out = asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["num_full_layers"] = self.num_full_layers
        out["num_sliding_layers"] = self.num_sliding_layers
        return out

    def to_hf_config(self) -> dict[str, Any]:
        """An HF ``config.json`` dict (transformers 5 names) that :meth:`from_hf_config` parses back."""
        return model_config_to_hf(self)


def _check_layer_type(layer_type: str) -> None:
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"unknown layer type {layer_type!r}; expected one of {LAYER_TYPES}")
