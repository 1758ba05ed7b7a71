"""Pool profiles: prefill time vs prompt length and decode step time vs batch size.

Two kinds, one interface (``prefill_time_s``, ``decode_step_s``, ``kv_capacity_bytes``):

- :class:`RooflineProfile` from public accelerator specifications (peak FLOP/s, memory bandwidth,
  memory size), for replicas of ``k`` accelerators (tensor parallel, assumed to keep the same
  utilisation; a scenario states its ``k``). FLOPs of a forward pass: 2 per parameter per token
  (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", ``C_forward ~ 2N``) plus attention,
  ``4 * n_q * d_head`` per (query, key) pair per layer (``QK^T`` and ``PV``, 2 FLOP per multiply-add;
  PaLM, Chowdhery et al. 2022, Appendix B counts the same ``4 L H Q T`` per token). A pair reads one
  key's K and V on that layer, ``2 * n_kv * d_head * dtype_bytes`` bytes, so attention costs
  ``a = 2 * n_q / (n_kv * dtype_bytes)`` FLOP per KV byte attended (:func:`attention_flops_per_kv_byte`;
  8 for 64 query heads over 8 bf16 KV heads), and the catalog's one KV formula gives the bytes:

  - Prefill (compute-bound): ``t_prefill(N) = (2 P N + a * sum_{i=1..N} kv_bytes(i)) / (k * peak_flops
    * u_prefill)``, query ``i`` attending ``kv_bytes(i)`` (``N`` tokens on full layers, ``min(i, W)``
    on sliding ones: quadratic in ``N`` on full layers, linear beyond ``W`` on sliding ones;
    :meth:`KVGeometry.cumulative_resident_bytes_array`).
  - A decode step over a batch of ``B`` sequences holding ``kv`` resident bytes is the roofline
    maximum (Williams et al. 2009, "Roofline") of compute and memory time:
    ``max((2 P B + a * kv) / (k * peak_flops * u_flops), (weight_bytes + kv) / (k * bandwidth * u_bw))``:
    every step reads all weights and the batch's whole resident KV (full and sliding layers).

- :class:`FittedProfile` from measured points (``ferry_profile`` or an imported file):
  ``t_prefill(N) = a0 + a1 * N + a2 * N**2`` and ``t_step(B) = b0 + b1 * B`` by least squares.

Both also give ``colocated_prefill_time_s(N)``: arrival to first token of a prompt on a replica that is
decoding at the time (a Ferry decode replica prefills the prompts at or under the threshold itself, in the
same continuous batch as its decodes). The prompt waits for the step in progress and then shares a step with
the decoding sequences. A fitted profile measures it (``colocated_prefill_points``: prefills sent while one
stream decodes on the same replica, read as ``t_prefill(N)`` plus their mean excess,
:func:`colocated_overhead_s`) or, without such points, uses ``t_prefill(N) + t_step(1) / 2``. A roofline
profile uses ``t_prefill(N) + t_step(1) / 2``: half a one-sequence step of waiting on average, and the decoding
sequences ride free in a compute-bound prefill step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inference_worker.planning.geometry import KVGeometry

# vLLM's default ``gpu_memory_utilization``: the share of accelerator memory the engine may use.
DEFAULT_MEMORY_UTILISATION = 0.9
MAX_FIT_X = 1e7
"""The largest prompt length or batch size :meth:`FittedProfile.fit` takes (beyond it the least squares is ill-posed)."""


def attention_flops_per_kv_byte(num_query_heads: int, num_kv_heads: int, kv_dtype_bytes: int) -> float:
    """Attention FLOP per KV byte attended: ``2 * n_q / (n_kv * dtype_bytes)`` (module docstring).

    ``4 * n_q * d_head`` FLOP per (query, key, layer) over ``2 * n_kv * d_head * dtype_bytes`` bytes.

    Raises:
        ValueError: a non-positive count, or ``num_query_heads`` not a multiple of ``num_kv_heads``.
    """
    if min(num_query_heads, num_kv_heads, kv_dtype_bytes) < 1 or num_query_heads % num_kv_heads:
        raise ValueError(f"need positive counts and num_query_heads a multiple of num_kv_heads, got "
                         f"{num_query_heads}, {num_kv_heads}, {kv_dtype_bytes}")
    return 2.0 * num_query_heads / (num_kv_heads * kv_dtype_bytes)


@dataclass(frozen=True)
class Accelerator:
    """Public specification of one accelerator."""

    name: str
    """Label, e.g. ``"H200"``."""
    peak_flops: float
    """Dense bf16 peak, FLOP/s (H200: 989e12; H20: 148e12)."""
    memory_bandwidth: float
    """HBM bandwidth, bytes/s (H200: 4.8e12; H20: 4.0e12)."""
    memory_bytes: float
    """HBM size, bytes (H200: 141e9; H20: 96e9)."""
    cost: float
    """Relative cost per accelerator (the scenario's unit: one "bandwidth" accelerator = 1)."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "memory_bytes", "cost"):
            if not getattr(self, name) > 0:
                raise ValueError(f"accelerator {self.name!r}: {name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RooflineProfile:
    """Roofline costs of a model of ``num_params`` parameters on replicas of ``accelerators_per_replica``."""

    accelerator: Accelerator
    """The accelerator type."""
    num_params: float
    """Model parameters (30e9 for the ``prfaas`` scenario)."""
    accelerators_per_replica: int = 1
    """Accelerators one replica spans (tensor parallel)."""
    prefill_flops_utilisation: float = 0.4
    """Share of peak FLOP/s a prefill achieves."""
    decode_bandwidth_utilisation: float = 0.6
    """Share of peak memory bandwidth a decode step achieves."""
    decode_flops_utilisation: float = 0.4
    """Share of peak FLOP/s a decode step achieves when compute-bound (large batches)."""
    weight_bytes_per_param: float = 2.0
    """Bytes per weight (bf16: 2)."""
    memory_utilisation: float = DEFAULT_MEMORY_UTILISATION
    """Share of the replica's memory for weights plus KV cache."""
    kv_geometry: KVGeometry | None = None
    """The model's KV bytes, for attention FLOPs (None: attention FLOPs not counted)."""
    attention_flops_per_kv_byte: float = 0.0
    """``a`` of the module docstring (:func:`attention_flops_per_kv_byte`); 0: attention FLOPs not counted."""

    def __post_init__(self) -> None:
        if not self.num_params > 0 or self.accelerators_per_replica < 1:
            raise ValueError("num_params must be positive and accelerators_per_replica >= 1")
        if self.attention_flops_per_kv_byte < 0 or (self.attention_flops_per_kv_byte and self.kv_geometry is None):
            raise ValueError("attention_flops_per_kv_byte must be >= 0 and needs kv_geometry")
        for name in ("prefill_flops_utilisation", "decode_bandwidth_utilisation", "decode_flops_utilisation",
                     "memory_utilisation"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.kv_capacity_bytes <= 0:
            raise ValueError(f"{self.num_params:.3g} parameters do not fit {self.accelerators_per_replica} x "
                             f"{self.accelerator.name}: no memory left for the KV cache")

    @property
    def flops_per_token(self) -> float:
        """2 FLOP per parameter per token (forward pass)."""
        return 2.0 * self.num_params

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights read by every decode step."""
        return self.num_params * self.weight_bytes_per_param

    @property
    def cost(self) -> float:
        """Cost of one replica (``accelerators_per_replica * accelerator.cost``)."""
        return self.accelerators_per_replica * self.accelerator.cost

    @property
    def kv_capacity_bytes(self) -> float:
        """KV cache bytes per replica: ``k * memory_bytes * memory_utilisation - weight_bytes``."""
        k = self.accelerators_per_replica
        return k * self.accelerator.memory_bytes * self.memory_utilisation - self.weight_bytes

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill speed without attention FLOPs, tokens/s: ``k * peak_flops * u_prefill / (2 * P)``."""
        return self._prefill_flops_per_s / self.flops_per_token

    @property
    def _prefill_flops_per_s(self) -> float:
        return self.accelerators_per_replica * self.accelerator.peak_flops * self.prefill_flops_utilisation

    def prefill_flops(self, num_tokens):
        """FLOPs of a prefill of ``num_tokens`` (scalar or array): ``2 P N + a * sum_{i<=N} kv_bytes(i)``."""
        n = np.asarray(num_tokens, dtype=float)
        flops = self.flops_per_token * n
        if self.attention_flops_per_kv_byte:
            top = max(int(np.max(n)) if n.size else 1, 1)
            flops = flops + self.attention_flops_per_kv_byte * self.kv_geometry.cumulative_resident_bytes_array(n, top)
        return flops if np.ndim(num_tokens) else float(flops)

    def prefill_time_s(self, num_tokens):
        """Seconds to prefill ``num_tokens`` (scalar or array): ``prefill_flops(N) / (k * peak_flops * u_prefill)``."""
        return self.prefill_flops(num_tokens) / self._prefill_flops_per_s

    @property
    def _decode_flops_per_s(self) -> float:
        return self.accelerators_per_replica * self.accelerator.peak_flops * self.decode_flops_utilisation

    @property
    def decode_compute_s_per_seq(self) -> float:
        """Compute time one sequence's weight FLOPs add to a decode step (s): ``2P / (k * peak_flops * u_flops)``."""
        return self.flops_per_token / self._decode_flops_per_s

    def decode_attention_s(self, kv_bytes: float) -> float:
        """Compute time of a decode step's attention over ``kv_bytes`` resident KV (s): ``a * kv / (k peak u_flops)``."""
        return self.attention_flops_per_kv_byte * kv_bytes / self._decode_flops_per_s

    @property
    def decode_bytes_per_s(self) -> float:
        """Achieved memory bandwidth of a decode step, bytes/s (``k * bandwidth * u_bw``)."""
        k = self.accelerators_per_replica
        return k * self.accelerator.memory_bandwidth * self.decode_bandwidth_utilisation

    def decode_step_s(self, batch_size: int, kv_bytes: float) -> float:
        """Seconds of one decode iteration of ``batch_size`` sequences reading ``kv_bytes`` of KV (roofline)."""
        return max(batch_size * self.decode_compute_s_per_seq + self.decode_attention_s(kv_bytes),
                   (self.weight_bytes + kv_bytes) / self.decode_bytes_per_s)

    def colocated_prefill_time_s(self, num_tokens):
        """Seconds from arrival to first token of ``num_tokens`` on a decoding replica: ``t_prefill(N) + t_step(1) / 2``
        (module docstring; the step reads the weights only, KV not counted)."""
        return self.prefill_time_s(num_tokens) + self.decode_step_s(1, 0.0) / 2


@dataclass(frozen=True)
class FittedProfile:
    """A profile fitted to measured points (seconds): quadratic prefill curve, linear decode step."""

    prefill_coefficients: tuple[float, float, float]
    """``(a0, a1, a2)``: ``t_prefill(N) = a0 + a1 * N + a2 * N**2`` seconds."""
    decode_coefficients: tuple[float, float]
    """``(b0, b1)``: ``t_step(B) = b0 + b1 * B`` seconds (KV read folded into the fit)."""
    kv_capacity_bytes: float
    """KV cache bytes per replica."""
    cost: float = 1.0
    """Cost of one replica."""
    label: str = ""
    """Hardware label and model version the points were measured with."""
    colocated_overhead_s: float | None = None
    """Seconds a prompt takes longer on a decoding replica than on an idle one (arrival to first token), at least 0;
    None: not measured (``colocated_prefill_time_s`` then estimates it)."""

    @classmethod
    def fit(cls, *, prefill_points: list[tuple[int, float]], decode_points: list[tuple[int, float]],
            kv_capacity_bytes: float, cost: float = 1.0, label: str = "",
            colocated_prefill_points: list[tuple[int, float]] | None = None) -> FittedProfile:
        """Least-squares fit (``numpy.polyfit``) of ``(num_tokens, seconds)`` and ``(batch_size, seconds)``.

        ``colocated_prefill_points`` (optional, ``(num_tokens, seconds)`` measured while the replica decodes) give
        ``colocated_overhead_s``: :func:`colocated_overhead_s` against the fitted prefill curve.

        Raises:
            ValueError: fewer than 3 distinct prefill lengths or 2 distinct batch sizes, a point that is not two
                numbers, an ``x`` outside ``1..MAX_FIT_X`` or a time that is not a positive finite number.
        """
        colocated = list(colocated_prefill_points or [])
        for name, points in (("prefill", prefill_points), ("decode", decode_points), ("co-located prefill", colocated)):
            for point in points:
                try:
                    x, t = (float(v) for v in point)
                except (TypeError, ValueError):
                    raise ValueError(f"{name} point {point!r}: expected (x, seconds), two numbers") from None
                if not (1 <= x <= MAX_FIT_X and 0 < t < float("inf")):
                    raise ValueError(f"{name} point {point!r}: x must be in 1..{MAX_FIT_X:g} and the time positive "
                                     "and finite (measured times must be positive)")
        distinct = [len({float(p[0]) for p in points}) for points in (prefill_points, decode_points)]
        if distinct[0] < 3 or distinct[1] < 2:
            raise ValueError("need at least 3 prefill points and 2 decode points to fit a profile, at distinct "
                             "lengths and batch sizes")
        prefill = fit_prefill(prefill_points)
        dn, dt = np.array(decode_points, dtype=float).T
        b1, b0 = np.polyfit(dn, dt, 1)
        return cls(prefill, (float(b0), float(b1)), float(kv_capacity_bytes), float(cost), label,
                   colocated_overhead_s(prefill, colocated) if colocated else None)

    def prefill_time_s(self, num_tokens):
        """Seconds to prefill ``num_tokens`` (scalar or array)."""
        return _quadratic(self.prefill_coefficients, num_tokens)

    def colocated_prefill_time_s(self, num_tokens):
        """Seconds from arrival to first token of ``num_tokens`` (scalar or array) on a decoding replica:
        ``t_prefill(N) + colocated_overhead_s``, else (not measured) ``t_prefill(N) + t_step(1) / 2`` (module
        docstring)."""
        if self.colocated_overhead_s is None:
            return self.prefill_time_s(num_tokens) + self.decode_step_s(1, 0.0) / 2
        return self.prefill_time_s(num_tokens) + self.colocated_overhead_s

    def decode_step_s(self, batch_size: int, kv_bytes: float) -> float:
        """Seconds of one decode iteration of ``batch_size`` sequences (``kv_bytes`` is in the fit)."""
        b0, b1 = self.decode_coefficients
        return b0 + b1 * batch_size


def colocated_overhead_s(prefill_coefficients: tuple[float, float, float],
                         colocated_points: list[tuple[int, float]]) -> float:
    """Mean of ``t_colocated - t_prefill(N)`` over the co-located points, at least 0 (seconds).

    A constant, not a second curve: what a decoding replica adds is the rest of the step in progress and the
    decoding sequences riding in the prompt's step, neither of which grows with the prompt (measured on the demo's
    CPU worker, 2026-12-04: +106, +105, +110 and +116 ms at 32, 128, 256 and 512 tokens). A curve fitted to these
    points alone bent the wrong way under load (a loaded CI machine measured 792, 622 and 366 ms at 16, 32 and 64
    tokens); their mean excess stays a usable figure. Never negative: a decoding replica does not prefill faster
    than an idle one (a point below the idle curve is noise).
    """
    excess = [t - _quadratic(prefill_coefficients, n) for n, t in colocated_points]
    return max(0.0, float(np.mean(excess)))


def fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """``(a0, a1, a2)`` of the least-squares quadratic (``numpy.polyfit``) through ``(num_tokens, seconds)`` points."""
    n, t = np.array(points, dtype=float).T
    a2, a1, a0 = np.polyfit(n, t, 2)
    return float(a0), float(a1), float(a2)


def lowest_prefill_time_s(coefficients: tuple[float, float, float], low: float, high: float) -> float:
    """The smallest value of ``a0 + a1 N + a2 N^2`` seconds over ``low <= N <= high`` (at an end or at the vertex
    ``-a1 / (2 a2)`` of an upward parabola)."""
    a0, a1, a2 = coefficients
    vertex = -a1 / (2 * a2) if a2 > 0 else None
    candidates = [low, high] + ([vertex] if vertex is not None and low < vertex < high else [])
    return min(float(_quadratic(coefficients, n)) for n in candidates)


def _quadratic(coefficients: tuple[float, float, float], num_tokens):
    a0, a1, a2 = coefficients
    n = np.asarray(num_tokens, dtype=float) if np.ndim(num_tokens) else float(num_tokens)
    return a0 + a1 * n + a2 * n * n
