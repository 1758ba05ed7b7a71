"""Ferry's pools as a planner scenario, and the recommendation: the fewest replicas meeting the SLOs.

No formula of its own: :mod:`inference_worker.planning.planner` predicts (TTFT percentiles by Erlang C with the
Allen-Cunneen factor, the link as processor sharing, decode as a fluid model of continuous batching: see its
docstring and sources) and :func:`~inference_worker.planning.planner.latency_threshold` is the router's one PD
cost function. This module only maps Ferry's objects onto the planner's:

- the **prefill pool** is the planner's ``remote_prefill`` (datacenter ``compute``), its profile the prefill pool's;
- the **decode pool** is the planner's ``decode`` with ``Fleet.colocated``: a Ferry decode replica prefills the
  prompts at or under the threshold itself, in the batch of its decodes (the planner's "co-located local
  prefill", with the decode profile's prefill measured while decoding);
- a profile fitted to measured points (:class:`FittedReplicaProfile`) stands where the planner reads a roofline
  profile.

The recommendation is the smallest total replica count ``R`` (1, 2, ... up to ``max_replicas``) for which
:meth:`Planner.size_fleet` (co-located) finds a split meeting the SLOs (at least ``attainment`` of requests within both the TTFT
and TPOT objectives, the link under ``max_link_share``) at the given arrival rate: each replica costs 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inference_worker.config import ModelConfig
from inference_worker.planning.geometry import KVGeometry
from inference_worker.planning.planner import Fleet, Planner, Prediction, latency_threshold
from inference_worker.planning.profiles import FittedProfile
from inference_worker.planning.scenario import Scenario
from inference_worker.planning.workload import LengthDistribution

CURVE_RATE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
"""The predicted TTFT curve: the recommended fleet at these multiples of the planned arrival rate."""
GRID_SIZE = 1000
"""Prompt quantile grid of the planner (the planner's default)."""


@dataclass(frozen=True)
class FittedReplicaProfile:
    """A :class:`FittedProfile` under the attribute names the planner's fluid decode model reads.

    The planner's decode step is ``beta + gamma * B`` with ``beta = weight_bytes / decode_bytes_per_s`` and
    ``gamma = decode_kv / decode_bytes_per_s`` (``decode_kv`` the mean resident KV of a decoding sequence,
    ``Planner.w.decode_kv``). A fitted step ``b0 + b1 * B`` is that line when
    ``decode_bytes_per_s = decode_kv / b1`` and ``weight_bytes = b0 * decode_bytes_per_s``. The compute cap
    (``x * decode_compute_s_per_seq < 0.9``) reads ``b1``: the share of time one sequence's tokens take.
    """

    fitted: FittedProfile
    decode_kv_bytes: float
    """``Planner.w.decode_kv`` of the scenario (bytes)."""
    cached_prefix_tokens: float = 0.0
    """Mean prompt tokens a request finds in the prefix cache (:attr:`Workload.cached_prefix_mean`): the ``N``
    computed tokens attend to them too (:meth:`prefill_time_s`)."""

    def __post_init__(self) -> None:
        b0, b1 = self.fitted.decode_coefficients
        if not (b0 > 0 and b1 > 0):
            raise ValueError(f"the decode step fit must have a positive intercept and slope, got b0={b0}, b1={b1}")

    cost = 1.0

    def prefill_time_s(self, num_tokens):
        """Seconds to prefill ``num_tokens`` computed tokens (scalar or array) after ``C`` cached ones: the fitted
        quadratic plus ``2 * max(a2, 0) * N * C``.

        The profile measures fresh prompts. A prompt whose first ``C`` tokens come from the prefix cache computes
        its last ``N``, and those attend to all ``N + C``. With ``t(N) = a0 + a1 N + a2 N^2`` (``a2 N^2`` the
        causal attention's ``N^2 / 2`` query-key pairs, ``2 a2`` seconds per pair), computing ``N`` tokens after
        ``C`` takes ``t(N + C) - t(C) + a0 = t(N) + 2 a2 N C``: the pairs of the whole prompt less those of the
        prefix. Measured on the demo's Gemma 3 270M worker (2 CPU threads): 190 tokens after 592 cached took
        0.78 s against 0.58 s fresh (+0.20 s); sweeps of prompts up to 512 tokens fit ``a2`` loosely, and give
        +0.14 to +0.33 s. A concave fit (``a2 < 0``) adds nothing.
        """
        return self.fitted.prefill_time_s(num_tokens) + self._cached_prefix_s(num_tokens)

    def colocated_prefill_time_s(self, num_tokens):
        """Seconds from arrival to first token of ``num_tokens`` on a decoding replica
        (:meth:`FittedProfile.colocated_prefill_time_s`, plus the cached prefix's share as in :meth:`prefill_time_s`)."""
        return self.fitted.colocated_prefill_time_s(num_tokens) + self._cached_prefix_s(num_tokens)

    def _cached_prefix_s(self, num_tokens):
        return 2 * max(self.fitted.prefill_coefficients[2], 0.0) * num_tokens * self.cached_prefix_tokens

    @property
    def decode_bytes_per_s(self) -> float:
        return self.decode_kv_bytes / self.fitted.decode_coefficients[1]

    @property
    def weight_bytes(self) -> float:
        return self.fitted.decode_coefficients[0] * self.decode_bytes_per_s

    @property
    def decode_compute_s_per_seq(self) -> float:
        return self.fitted.decode_coefficients[1]

    @property
    def kv_capacity_bytes(self) -> float:
        return self.fitted.kv_capacity_bytes

    def decode_attention_s(self, kv_bytes: float) -> float:
        """0 s: a measured step's attention over its sequences' KV is inside the fitted slope ``b1``, which
        :attr:`decode_compute_s_per_seq` already charges per sequence (a roofline profile computes the two apart)."""
        return 0.0

    def decode_step_s(self, batch_size: int, kv_bytes: float = 0.0) -> float:
        """The fitted step ``b0 + b1 * batch_size`` seconds."""
        return self.fitted.decode_step_s(batch_size, kv_bytes)


@dataclass(frozen=True)
class Workload:
    """What the planner serves: lengths (tokens), Poisson arrivals (req/s) and the objectives."""

    prompt_median: int
    prompt_p90: int | None
    prompt_cap: int
    output_median: int
    rate_per_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    attainment: float = 0.9
    max_link_share: float = 1.0
    cached_prefix_mean: float = 0.0
    """Mean prompt tokens per request found in a prefix cache (a conversation's earlier turns): not computed, but
    attended to. The prompt lengths above are the computed tokens."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cached_prefix_mean) and self.cached_prefix_mean >= 0):
            raise ValueError(f"cached_prefix_mean must be a finite number of tokens >= 0, got {self.cached_prefix_mean}")


@dataclass(frozen=True)
class Recommendation:
    """The planner's answer for Ferry's two pools."""

    prefill_replicas: int
    decode_replicas: int
    fleet: Fleet
    prediction: Prediction
    curve: list[dict]
    """``[{rate_per_s, ttft_p50_s, ttft_p90_s}]`` of the recommended fleet (None where a queue is unstable)."""


def _finite(value: float) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else float(value)


def prefill_speed_tokens_per_s(profile: FittedProfile, num_tokens: int) -> float:
    """Mean prefill speed at ``num_tokens``: ``num_tokens / t_prefill(num_tokens)`` tokens/s.

    Raises:
        ValueError: the fitted time is not positive there.
    """
    seconds = float(profile.prefill_time_s(num_tokens))
    if not seconds > 0:
        raise ValueError(f"the prefill fit predicts {seconds:.3g} s at {num_tokens} tokens: measure longer prompts")
    return num_tokens / seconds


def build_scenario(*, config: ModelConfig, prefill: FittedProfile, decode: FittedProfile, bandwidth_gbps: float,
                   rtt_s: float, workload: Workload, budget: float, max_num_seqs: int = 256) -> Scenario:
    """The planner's :class:`Scenario` for a prefill and a decode pool of the model ``config``.

    Raises:
        ValueError: an invalid workload (lengths) or a decode fit without a positive slope.
    """
    geometry = KVGeometry(config)
    prompt = LengthDistribution(workload.prompt_median, workload.prompt_p90, workload.prompt_cap)
    output = LengthDistribution(workload.output_median, None, max(workload.output_median, 1))

    def scenario(decode_kv: float) -> Scenario:
        return Scenario(
            name="ferry", geometry=geometry,
            profiles={"compute": FittedReplicaProfile(prefill, decode_kv, workload.cached_prefix_mean),
                      "bandwidth": FittedReplicaProfile(decode, decode_kv, workload.cached_prefix_mean)},
            bandwidth_gbps=bandwidth_gbps, rtt_s=rtt_s, prompt=prompt, output=output,
            ttft_slo_s=workload.ttft_slo_s, tpot_slo_s=workload.tpot_slo_s, slo_attainment=workload.attainment,
            budget=budget, max_num_seqs=max_num_seqs, max_link_share=workload.max_link_share,
            threshold_bounds=(0.5, 2.0))

    # The planner computes the mean resident KV of a decoding sequence from the scenario's lengths; the fitted
    # profile needs it to express its step slope in the planner's terms (FittedReplicaProfile).
    decode_kv = Planner(scenario(1.0), GRID_SIZE).w.decode_kv
    return scenario(float(decode_kv))


def planned_threshold(scenario: Scenario, prefill: FittedProfile, decode: FittedProfile) -> int | None:
    """The remote-prefill threshold by the router's one PD cost function
    (:func:`~inference_worker.planning.planner.latency_threshold`), both prefill speeds taken at the prompt median.

    Returns ``T`` (remote above ``T``; -1 always remote) or None (remote never pays off up to the prompt cap).
    """
    n = scenario.prompt.median
    return latency_threshold(scenario.geometry,
                             local_prefill_tokens_per_s=prefill_speed_tokens_per_s(decode, n),
                             remote_prefill_tokens_per_s=prefill_speed_tokens_per_s(prefill, n),
                             bandwidth_gbps=scenario.bandwidth_gbps, rtt_s=scenario.rtt_s,
                             max_tokens=scenario.prompt.cap)


def recommend(scenario: Scenario, threshold: int | None, *, rate_per_s: float, max_replicas: int
              ) -> Recommendation | None:
    """The smallest fleet (total replicas ``1..max_replicas``) meeting the SLOs at ``rate_per_s``, or None.

    Bisection on the total: a replica more never makes a fleet miss the objectives it met (it only adds a server
    to a queue), so the totals that meet them are an interval ending at ``max_replicas`` (about ``log2(max)``
    sizings instead of ``max``: 9 instead of 256).
    """
    planner = Planner(scenario, GRID_SIZE)
    rate = rate_per_s

    def size(budget: int) -> tuple[Fleet, Prediction] | None:
        return planner.size_fleet(threshold, rate, budget=float(budget), colocated=True)

    found = size(max_replicas) if max_replicas >= 1 else None
    if found is None:
        return None
    low, high = 0, max_replicas  # size(low) fails (0 replicas serve nothing), size(high) meets the objectives
    while high - low > 1:
        middle = (low + high) // 2
        if (at_middle := size(middle)) is not None:
            high, found = middle, at_middle
        else:
            low = middle
    fleet, prediction = found
    curve = []
    for factor in CURVE_RATE_FACTORS:
        at = planner.predict(fleet, rate * factor)
        curve.append({"rate_per_s": rate * factor, "ttft_p50_s": _finite(at.ttft_p50_s),
                      "ttft_p90_s": _finite(at.ttft_p90_s)})
    return Recommendation(fleet.remote_prefill, fleet.decode, fleet, prediction, curve)


def plan(*, config: ModelConfig, prefill: FittedProfile, decode: FittedProfile, bandwidth_gbps: float, rtt_s: float,
         workload: Workload, max_replicas: int) -> tuple[int | None, Recommendation | None]:
    """``(threshold, recommendation or None)`` for ``workload`` on the two pools' profiles.

    Raises:
        ValueError: invalid lengths, a decode fit without positive slope, or a prefill fit that is not positive
            at the prompt median.
    """
    scenario = build_scenario(config=config, prefill=prefill, decode=decode, bandwidth_gbps=bandwidth_gbps,
                              rtt_s=rtt_s, workload=workload, budget=float(max_replicas))
    threshold = planned_threshold(scenario, prefill, decode)
    return threshold, recommend(scenario, threshold, rate_per_s=workload.rate_per_s, max_replicas=max_replicas)
