"""Attention-type names, architecture rules and the KV accounting formula (torch-free, no I/O).

KV accounting (DESIGN.md, "KV accounting"): with ``b = 2 * num_kv_heads * head_dim * dtype_bytes``
bytes per token per layer (K and V), the KV resident while computing token ``N`` is
``b * (num_full_layers * N + num_sliding_layers * min(N, W))``; the all-full (dense) equivalent is
``b * num_layers * N``. Block rounding of a real paged cache is not included.
"""

from __future__ import annotations

from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
SUPPORTED_ARCHITECTURES = ("gemma3", "llama")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Gemma 3: one full-attention layer after every five sliding ones (layer i is full iff (i+1) % 6 == 0).
# Source: Gemma 3 technical report (5:1 local:global) and HF Gemma3TextConfig's default layer_types.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
# Gemma 3 RoPE base for local (sliding) layers. GGUF files carry only the global base
# (``gemma3.rope.freq_base``), so this architecture default (HF Gemma3TextConfig) is used for them.
GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ = 10_000.0


def kv_bytes_per_token(*, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for one token in one layer: ``2 * num_kv_heads * head_dim * dtype_bytes``.

    Raises:
        ValueError: if any argument is not a positive integer.
    """
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        require_positive_int(name, value)
    return 2 * num_kv_heads * head_dim * dtype_bytes


def kv_bytes(
    num_tokens: int,
    *,
    num_full_layers: int,
    num_sliding_layers: int,
    sliding_window: int | None,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int = 2,
    hybrid: bool = True,
) -> int:
    """KV-cache bytes resident while computing token ``num_tokens`` (DESIGN.md planner formula).

    ``hybrid=True``: ``b * (num_full_layers * N + num_sliding_layers * min(N, W))``.
    ``hybrid=False`` (dense equivalent, every layer full): ``b * (num_full_layers + num_sliding_layers) * N``.
    ``b`` is :func:`kv_bytes_per_token`. Block rounding is not included.

    Raises:
        ValueError: on negative counts, or sliding layers without a positive ``sliding_window``.
    """
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    for name, value in (("num_full_layers", num_full_layers), ("num_sliding_layers", num_sliding_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if num_sliding_layers and (sliding_window is None or sliding_window <= 0):
        raise ValueError(
            f"{num_sliding_layers} sliding layers need a positive sliding_window, got {sliding_window!r}"
        )
    b = kv_bytes_per_token(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    if not hybrid:
        return b * (num_full_layers + num_sliding_layers) * num_tokens
    sliding_tokens = min(num_tokens, sliding_window) if num_sliding_layers else 0
    return b * (num_full_layers * num_tokens + num_sliding_layers * sliding_tokens)


MAX_HIDDEN_LAYERS = 4096
"""More decoder layers than any published model has (Llama 3.1 405B: 126); a bound on what a config may claim."""


def derive_layer_types(architecture: str, num_hidden_layers: int, sliding_window: int | None) -> tuple[str, ...]:
    """The architecture's rule for ``layer_types`` when the file has none (GGUF never has them).

    Gemma 3: layer ``i`` is full iff ``(i + 1) % 6 == 0`` (all full if there is no window).
    Llama: every layer full.

    Raises:
        ValueError: for an unsupported architecture, or ``num_hidden_layers`` not an integer in
            1..:data:`MAX_HIDDEN_LAYERS` (a config claiming 10**12 layers made this a 10**12-entry tuple: a web
            process registering it hung and grew until the machine ran out of memory).
    """
    if not isinstance(num_hidden_layers, int) or isinstance(num_hidden_layers, bool) \
            or not 1 <= num_hidden_layers <= MAX_HIDDEN_LAYERS:
        raise ValueError(f"num_hidden_layers must be an integer in 1..{MAX_HIDDEN_LAYERS}, got {num_hidden_layers!r}")
    if architecture == "gemma3":
        if sliding_window is None:
            return (FULL_ATTENTION,) * num_hidden_layers
        return tuple(
            FULL_ATTENTION if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0 else SLIDING_ATTENTION
            for i in range(num_hidden_layers)
        )
    if architecture == "llama":
        return (FULL_ATTENTION,) * num_hidden_layers
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")



def require_positive_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an ``int`` (not a ``bool``) above 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
