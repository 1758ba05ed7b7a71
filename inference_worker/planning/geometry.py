"""A model's KV bytes for planning: resident in the decode cache and shipped over the link.

No formula of its own: both byte counts come from the one KV accounting of
:mod:`inference_worker.config` (``ModelConfig.kv_bytes``: resident KV) and
:meth:`inference_worker.kv_transfer.layout.KVLayout.transfer_bytes` (what a prefill hands to
decode). Both are piecewise linear in the token count with breakpoints at the sliding windows, so
vectorised versions evaluate the one formula at the breakpoints and interpolate linearly between
them (exact: the functions are linear between breakpoints). The sum of ``resident_bytes(i)`` over a
prompt's positions ``i = 1..N`` (the KV a causal prefill's attention reads, query by query) is
summed the same way: an arithmetic series on each linear piece, exact in integer positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inference_worker.config import DTYPE_BYTES, FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from inference_worker.kv_transfer.layout import KVLayout


def hypothetical_model_config(*, num_layers: int, num_full_layers: int, sliding_window: int | None,
                              num_kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16",
                              max_position_embeddings: int = 131072) -> ModelConfig:
    """A :class:`ModelConfig` for a model known only by its KV geometry (a planning scenario's model).

    Full-attention layers are spread evenly (layer ``i`` is full iff ``(i + 1) * F // L`` steps up,
    e.g. every 6th of 48 layers for ``F = 8``); their position does not change any byte count.
    Fields the KV accounting does not read (hidden sizes, vocabulary, RoPE) get placeholder values
    (``hidden_size = num_kv_heads * head_dim``, one query head per KV head).

    Raises:
        ValueError: ``num_full_layers`` outside ``0..num_layers``, sliding layers without a window,
            or any value :class:`ModelConfig` rejects.
    """
    if not 0 <= num_full_layers <= num_layers:
        raise ValueError(f"num_full_layers must be in 0..{num_layers}, got {num_full_layers}")
    if kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"kv_dtype must be one of {sorted(DTYPE_BYTES)}, got {kv_dtype!r}")
    layer_types = tuple(
        FULL_ATTENTION if (i + 1) * num_full_layers // num_layers > i * num_full_layers // num_layers
        else SLIDING_ATTENTION
        for i in range(num_layers)
    )
    return ModelConfig(
        architecture="llama", num_hidden_layers=num_layers, hidden_size=num_kv_heads * head_dim,
        intermediate_size=4 * num_kv_heads * head_dim, num_attention_heads=num_kv_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, vocab_size=32000,
        max_position_embeddings=max_position_embeddings, layer_types=layer_types,
        sliding_window=sliding_window if num_full_layers < num_layers else None,
        rope_theta=10000.0, rope_local_base_freq=None, rms_norm_eps=1e-6, dtype=kv_dtype,
        tie_word_embeddings=False,
    )


@dataclass(frozen=True)
class KVGeometry:
    """KV byte counts of one model (KV dtype ``config.dtype``), scalar and vectorised.

    ``resident_bytes(N)`` is ``ModelConfig.kv_bytes(N)`` (DESIGN.md "KV accounting":
    ``b * (F * N + S * min(N, W))``); ``transfer_bytes(N)`` is ``KVLayout.transfer_bytes(N)``
    (``b * (F * N + S * min(N, W - 1))``); ``dense=True`` counts every layer as full attention (the
    dense model of the same shape).
    """

    config: ModelConfig
    """The model (its ``dtype`` is the KV dtype)."""
    dense: bool = False
    """Treat every layer as full attention (a dense model of the same size)."""

    @property
    def layout(self) -> KVLayout:
        """The transfer layout (all layers full when ``dense``)."""
        layout = KVLayout.from_model_config(self.config)
        if self.dense:
            return KVLayout((None,) * layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype)
        return layout

    def resident_bytes(self, num_tokens: int) -> int:
        """KV bytes resident in the decode cache at ``num_tokens`` tokens (``ModelConfig.kv_bytes``)."""
        return self.config.kv_bytes(num_tokens, hybrid=not self.dense, dtype_bytes=DTYPE_BYTES[self.config.dtype])

    def transfer_bytes(self, num_tokens: int) -> int:
        """KV bytes shipped after a prefill of ``num_tokens`` (``KVLayout.transfer_bytes``)."""
        return self.layout.transfer_bytes(num_tokens)

    def _breakpoints(self, max_tokens: int, offset: int) -> np.ndarray:
        w = self.config.sliding_window
        points = {0, 1, max_tokens}
        if w is not None and not self.dense and w - offset < max_tokens:
            points.add(max(w - offset, 0))
        return np.array(sorted(points), dtype=np.int64)

    def resident_bytes_array(self, num_tokens: np.ndarray, max_tokens: int) -> np.ndarray:
        """``resident_bytes`` of each entry of ``num_tokens`` (values in ``0..max_tokens``), float64."""
        xs = self._breakpoints(max_tokens, 0)
        return np.interp(num_tokens, xs, [self.resident_bytes(int(x)) for x in xs])

    def transfer_bytes_array(self, num_tokens: np.ndarray, max_tokens: int) -> np.ndarray:
        """``transfer_bytes`` of each entry of ``num_tokens`` (values in ``0..max_tokens``), float64."""
        xs = self._breakpoints(max_tokens, 1)
        return np.interp(num_tokens, xs, [self.transfer_bytes(int(x)) for x in xs])

    def cumulative_resident_bytes_array(self, num_tokens: np.ndarray, max_tokens: int) -> np.ndarray:
        """``sum(resident_bytes(i) for i in 1..N)`` for each ``N`` of ``num_tokens`` (values in ``0..max_tokens``).

        The KV bytes a causal prefill of ``N`` tokens reads: query ``i`` attends to the ``resident_bytes(i)``
        bytes of its own and earlier positions (``min(i, W)`` of them on a sliding layer). On each linear
        piece ``[a, c]`` of ``resident_bytes`` (slope ``s``), ``sum(f(i) for i in a+1..N) = (N - a) f(a) +
        s (N - a)(N - a + 1) / 2``; the pieces' sums are accumulated at the breakpoints. Float64, exact
        to rounding.
        """
        xs = self._breakpoints(max_tokens, 0)
        f = np.array([self.resident_bytes(int(x)) for x in xs], dtype=float)
        slopes = np.diff(f) / np.maximum(np.diff(xs), 1)
        seg = np.diff(xs)
        # cumulative sum at each breakpoint: C(x_{k+1}) = C(x_k) + sum over i in x_k+1..x_{k+1}
        pieces = seg * f[:-1] + slopes * seg * (seg + 1) / 2
        at_breaks = np.concatenate([[0.0], np.cumsum(pieces)])
        n = np.asarray(num_tokens, dtype=float)
        k = np.clip(np.searchsorted(xs, n, side="right") - 1, 0, len(xs) - 2)
        d = n - xs[k]
        return at_breaks[k] + d * f[k] + slopes[k] * d * (d + 1) / 2
