"""Which KV a prefill hands to decode, and how many bytes that is (torch-free).

After a prefill of ``N`` tokens the next decode step (the query at position ``N``) reads, per
DESIGN's window convention (query ``i`` sees keys ``i-W < j <= i``):

- full-attention layers: all ``N`` cached positions ``0 .. N-1``;
- sliding layers with window ``W``: positions ``N-W+1 .. N-1``, i.e. the last ``min(N, W-1)``
  tokens (the new token brings its own K/V, which is the W-th key).

:class:`KVLayout` describes a model's KV tensors per layer (from
:class:`inference_worker.config.ModelConfig`) and :func:`transfer_tokens` /
:meth:`KVLayout.transfer_bytes` give the exact counts the wire format carries. The router imports
this module, so it must stay free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_worker.config import DTYPE_BYTES, FULL_ATTENTION, SLIDING_ATTENTION, kv_bytes_per_token


def transfer_tokens(num_tokens: int, sliding_window: int | None) -> int:
    """Tokens of one layer's KV sent after a prefill of ``num_tokens`` tokens.

    ``num_tokens`` for a full layer (``sliding_window`` None), ``min(num_tokens, W - 1)`` for a sliding
    layer with window ``W``.

    Raises:
        ValueError: ``num_tokens`` negative or ``sliding_window`` not a positive integer.
    """
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    if sliding_window is None:
        return num_tokens
    if not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    return min(num_tokens, sliding_window - 1)


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's per-layer KV cache as transferred.

    Each layer's K and V have shape ``[num_layer_tokens, num_kv_heads, head_dim]`` in ``dtype``.
    """

    layer_windows: tuple[int | None, ...]
    """Per layer: sliding window W in tokens, or None for a full-attention layer."""
    num_kv_heads: int
    """KV heads per layer."""
    head_dim: int
    """Width of one head."""
    dtype: str
    """KV dtype name: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        if not self.layer_windows:
            raise ValueError("a KV layout needs at least one layer")
        for i, w in enumerate(self.layer_windows):
            if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
                raise ValueError(f"layer {i}: sliding window must be a positive integer or None, got {w!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        # Validates num_kv_heads and head_dim as positive integers.
        kv_bytes_per_token(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    @classmethod
    def from_model_config(cls, config, dtype: str | None = None) -> KVLayout:
        """Layout of a :class:`inference_worker.config.ModelConfig` (``layer_types``, ``sliding_window``).

        ``dtype`` is the KV cache dtype; defaults to the config's ``dtype``.
        """
        windows = []
        for layer_type in config.layer_types:
            if layer_type == SLIDING_ATTENTION:
                windows.append(config.sliding_window)
            elif layer_type == FULL_ATTENTION:
                windows.append(None)
            else:
                raise ValueError(f"unknown layer type {layer_type!r}")
        return cls(tuple(windows), config.num_key_value_heads, config.head_dim, dtype or config.dtype)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        """Parse ``{"layer_types": [...], "sliding_window": W, "num_kv_heads": H, "head_dim": D, "dtype": ...}``.

        Raises:
            ValueError: a key is missing or a value is invalid.
        """
        try:
            windows = []
            for layer_type in data["layer_types"]:
                if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
                    raise ValueError(f"unknown layer type {layer_type!r}")
                windows.append(data["sliding_window"] if layer_type == SLIDING_ATTENTION else None)
            return cls(tuple(windows), int(data["num_kv_heads"]), int(data["head_dim"]), str(data["dtype"]))
        except KeyError as exc:
            raise ValueError(f"KV layout is missing {exc.args[0]!r}") from exc

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layer_windows)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes of one token in one layer (``2 * num_kv_heads * head_dim * dtype_bytes``)."""
        return kv_bytes_per_token(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                  dtype_bytes=self.dtype_bytes)

    def layer_tokens(self, num_tokens: int) -> tuple[int, ...]:
        """Per layer, the tokens sent after a prefill of ``num_tokens`` (see :func:`transfer_tokens`)."""
        return tuple(transfer_tokens(num_tokens, w) for w in self.layer_windows)

    def transfer_bytes(self, num_tokens: int) -> int:
        """Raw KV bytes sent after a prefill of ``num_tokens``: ``b * sum(layer_tokens(N))``."""
        return self.kv_bytes_per_token * sum(self.layer_tokens(num_tokens))

    def dense_bytes(self, num_tokens: int) -> int:
        """Bytes an all-full-attention model of the same shape would send: ``b * num_layers * N``."""
        return self.kv_bytes_per_token * self.num_layers * num_tokens
