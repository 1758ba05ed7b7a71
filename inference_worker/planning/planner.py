"""The capacity planner: replicas per pool, the remote-prefill threshold, link load, TTFT/TPOT.

System (DESIGN.md "Planning beyond one machine"): prompts of more than ``T`` tokens prefill remotely
on ``remote_prefill`` replicas in datacenter ``compute`` and ship their KV over the link; the others
prefill on ``local_prefill`` replicas next to the ``decode`` replicas in datacenter ``bandwidth``
(intra-datacenter KV hand-off is not modelled: RDMA within a datacenter).

Costs come from the scenario's profiles (:mod:`.profiles`: a replica is ``accelerators_per_replica``
accelerators, one 8-accelerator node in ``prfaas``, ASSUMED; prefill FLOPs include attention, decode
steps read weights and the resident KV of full and sliding layers). Homogeneous PD is planned on
:meth:`Scenario.homogeneous` (both pools on one type; the caller plans both types and keeps the better).
Fleet sizing (:meth:`Planner.size_fleet`, :meth:`Planner.plan_bandwidth_aware`) searches the split of
the one budget per policy: decode gets the fewest replicas meeting TPOT, and every division of the rest
between remote (``compute``) and local (``bandwidth``) prefill is tried (bandwidth-aware: remote pools
up to the link-limited size), keeping the best predicted attainment or goodput.

Formulas (``lambda`` the arrival rate, expectations over the prompt distribution's quantile grid):

- Prefill pools are M/G/c FIFO queues of one request per replica. Probability of waiting: Erlang C,
  ``C(c, a)`` with offered load ``a = lambda * E[S]``. Waiting-time tail ``P(W > t) = C * exp(-theta t)``,
  ``theta = (c / E[S] - lambda) * 2 / (1 + cs^2)``: exact for M/M/c (Erlang), with the mean scaled by the
  Allen-Cunneen factor ``(1 + cs^2) / 2`` for general service times (``cs^2`` the squared coefficient
  of variation; Allen, "Probability, Statistics and Queueing Theory", 1990).
- The link is a processor-sharing queue: a transfer of ``x`` bytes takes ``x / (B * (1 - rho))`` on
  average (M/G/1-PS conditional response time, Kleinrock, "Queueing Systems" vol. 2, 1976), with
  ``rho = lambda_remote * E[bytes] / B``. Link load: ``lambda * E[bytes(N); N > T]`` (Gbit/s).
- ``TTFT(N) = W + t_prefill(N)`` locally, ``W + t_prefill(N) + x(N) / (B (1 - rho)) + RTT`` remotely
  (the first token comes from the prefill and reaches the client with the KV); its distribution is
  the mixture over prompt lengths, percentiles by bisection on the CDF.
- Decode, as a fluid model of continuous batching: each replica carries ``x = lambda * E[out] / D``
  tokens/s; with the step time ``beta + gamma * (1 + B)`` (``beta`` weights, ``gamma`` one sequence's KV read;
  a decoding sequence's step carries itself and the ``B`` others it finds, by PASTA) and Little's law
  ``B = x * TPOT``, ``TPOT = (beta + gamma) / (1 - gamma * x)`` while compute allows
  (``x * (2P + a * kv) / flops < max_decode_utilisation``, ``a * kv`` one sequence's attention FLOPs,
  :mod:`.profiles`). The fluid model has no queueing, hence the utilisation cap.
- Goodput (DistServe, Zhong et al., OSDI 2024): the highest rate at which at least ``slo_attainment``
  of requests meet both TTFT and TPOT objectives.
- **Co-located local prefill** (``Fleet.colocated``: a Ferry decode replica prefills the prompts at or
  under the threshold itself, in the same continuous batch as its decodes). The ``D`` decode replicas are
  the local prefill pool too. Decode steps run whenever a sequence decodes; a waiting prompt joins the next
  step (vLLM-style mixed batches), so decoding acts as server vacations taken while no prompt waits. By
  the decomposition property of M/G/1 with vacations (Fuhrmann and Cooper, "Stochastic Decompositions in
  the M/G/1 Queue with Generalized Vacations", Operations Research 33(5), 1985) the prompt's delay is the
  M/G/c wait of the prompts alone plus the residual of the step in progress. The profile's
  ``colocated_prefill_time_s(N)`` holds that residual and the shared step, measured with one stream
  decoding. A prompt finds the replica decoding with probability ``p = 1 - exp(-B)``, ``B`` the mean
  decoding sequences per replica (Poisson occupancy of M/G/infinity; an arrival sees the time average,
  PASTA). Its service time is then ``p * (t_colocated(N) + 1.5 * t_seq * (B / p - 1)) + (1 - p) *
  t_prefill(N)``: ``t_colocated`` was measured with one sequence decoding, and each of the ``B / p - 1``
  more sequences found on a decoding replica adds its share of a step, ``t_seq`` (``gamma``, the step's
  slope), to the prompt's step and half of it to the residual of the step in progress. A decoding
  sequence sees itself and ``B`` others (PASTA again): ``t_step = beta + gamma * (1 + B)``, as in the fluid
  model. The decoding sequences get one token per step. Prompt
  steps take ``rho_p`` of the replica's time (``rho_p = lambda_local * E[service] / D``), and
  ``lambda_local / D`` of them come per second. Decode steps fill the rest, ``(1 - rho_p) / t_step(B)``
  per second. So ``TPOT = 1 / ((1 - rho_p) / t_step(B) + lambda_local / D)``, with ``B = x * TPOT``
  (Little's law) solved by fixed-point iteration.

:func:`latency_threshold` is the router's one PD cost function (:mod:`inference_worker.router.pd_cost`) fed
with the planner's inputs; with the defaults (remote prefill free, no queues, the whole link) it is the
router's cold-fleet ``derived_threshold``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from inference_worker.planning.geometry import KVGeometry
from inference_worker.planning.scenario import Scenario
from inference_worker.router.pd_cost import PDProfile, derived_threshold

MAX_DECODE_UTILISATION = 0.9
FIXED_POINT_ITERATIONS = 200
"""Most iterations of the co-located TPOT fixed point (it stops once TPOT moves by under 1e-13 of itself)."""
COLOCATED_CACHE_SIZE = 4096
NEVER = None  # threshold meaning "never remote"


def latency_threshold(geometry: KVGeometry, *, local_prefill_tokens_per_s: float, bandwidth_gbps: float,
                      rtt_s: float, remote_prefill_tokens_per_s: float = math.inf, local_wait_s: float = 0.0,
                      remote_wait_s: float = 0.0, link_share_used: float = 0.0,
                      max_tokens: int = 131072) -> int | None:
    """Largest prompt length that still prefills locally, by the router's one PD cost function.

    This is :func:`inference_worker.router.pd_cost.derived_threshold` fed with the planner's inputs (a
    profile's speeds, the pools' queue waits, the link share already in use): remote prefill of ``N``
    tokens pays off when
    ``local_wait + N / s_local > remote_wait + N / s_remote + bytes(N) / (B * (1 - link_share_used)) + RTT``,
    ``bytes(N)`` the KV shipped (``KVLayout.transfer_bytes``), ``B = bandwidth_gbps * 1e9 / 8`` bytes/s.
    ``remote_prefill_tokens_per_s = inf`` (the default) charges no remote prefill time, which with no waits
    and the whole link is the router's cold-fleet threshold.

    Returns:
        ``T`` (remote for every ``num_prompt_tokens > T``; -1: always remote) or None when remote never pays
        off up to ``max_tokens``.

    Raises:
        ValueError: non-positive speeds or bandwidth, negative RTT or waits, a link share outside [0, 1).
    """
    if remote_prefill_tokens_per_s <= 0:
        raise ValueError("prefill speeds and bandwidth_gbps must be positive")
    profile = PDProfile(layout=geometry.layout, decode_prefill_tokens_per_s=local_prefill_tokens_per_s,
                        bandwidth_gbps=bandwidth_gbps, rtt_s=rtt_s,
                        prefill_tokens_per_s=None if math.isinf(remote_prefill_tokens_per_s)
                        else remote_prefill_tokens_per_s,
                        decode_wait_s=local_wait_s, prefill_wait_s=remote_wait_s, link_share_used=link_share_used)
    return derived_threshold(profile, max_tokens)


def erlang_c(servers: int, offered_load: float) -> float:
    """Erlang C: probability an arrival waits in M/M/c with ``servers`` and ``offered_load = lambda E[S]``.

    Via the Erlang B recursion ``B_k = a B_{k-1} / (k + a B_{k-1})`` and ``C = B / (1 - rho (1 - B))``.

    Raises:
        ValueError: ``offered_load >= servers`` (unstable) or negative.
    """
    if offered_load < 0 or offered_load >= servers:
        raise ValueError(f"offered load {offered_load} must be in [0, {servers})")
    b = 1.0
    for k in range(1, servers + 1):
        b = offered_load * b / (k + offered_load * b)
    rho = offered_load / servers
    return b / (1 - rho * (1 - b))


@dataclass(frozen=True)
class Fleet:
    """Replicas per pool and the remote-prefill threshold."""

    remote_prefill: int
    """Prefill replicas in datacenter ``compute``."""
    local_prefill: int
    """Prefill replicas in datacenter ``bandwidth``."""
    decode: int
    """Decode replicas in datacenter ``bandwidth``."""
    threshold_tokens: int | None
    """Prompts with more tokens prefill remotely; None: never remote; 0: always."""
    colocated: bool = False
    """The decode replicas prefill the local prompts themselves (Ferry's decode pool): ``local_prefill`` must be 0
    (module docstring, "co-located local prefill")."""

    def __post_init__(self) -> None:
        for name in ("remote_prefill", "local_prefill", "decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number of replicas >= 0, got {value!r}")
        if self.colocated and self.local_prefill:
            raise ValueError(f"a co-located fleet prefills locally on its decode replicas: local_prefill must be 0, "
                             f"got {self.local_prefill}")

    def cost(self, scenario: Scenario) -> float:
        """Total accelerator cost."""
        c, b = scenario.profiles["compute"].cost, scenario.profiles["bandwidth"].cost
        return self.remote_prefill * c + (self.local_prefill + self.decode) * b

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    """The planner's prediction for a fleet at an arrival rate (NaN where a queue is unstable)."""

    rate_per_s: float
    """Arrival rate, requests/s."""
    ttft_p50_s: float
    """Median TTFT, seconds."""
    ttft_p90_s: float
    """90th percentile TTFT, seconds."""
    tpot_s: float
    """TPOT of the fluid decode model, seconds per output token."""
    attainment: float
    """Share of requests meeting both objectives."""
    link_gbps: float
    """Mean KV traffic on the link, Gbit/s."""
    link_share: float
    """``link_gbps`` over the link's bandwidth."""
    remote_share: float
    """Share of requests prefilled remotely."""
    decode_batch: float
    """Mean decode batch per replica."""

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


class _Workload:
    """The prompt quantile grid with its prefill times and KV bytes (computed once per scenario)."""

    def __init__(self, scenario: Scenario, grid_size: int):
        self.n = scenario.prompt.quantile_grid(grid_size)
        cap = scenario.prompt.cap + scenario.output.cap
        self.bytes = scenario.geometry.transfer_bytes_array(self.n, cap)
        self.mean_out = float(scenario.output.quantile_grid(200).mean())
        self.decode_kv = scenario.geometry.resident_bytes_array(self.n + self.mean_out / 2, cap).mean()
        self.t_local = scenario.profiles["bandwidth"].prefill_time_s(self.n)
        self.t_remote = scenario.profiles["compute"].prefill_time_s(self.n)


class Planner:
    """Predictions, fleet sizing and threshold choice for one scenario."""

    def __init__(self, scenario: Scenario, grid_size: int = 1000):
        self.scenario = scenario
        self.w = _Workload(scenario, grid_size)
        self._colocated_cache: dict[tuple, tuple[float, float, np.ndarray, float]] = {}

    # ------------------------------------------------------------------ prediction
    def _pool(self, weight: np.ndarray, times: np.ndarray, servers: int, rate: float):
        """(P(wait), theta) of an M/G/c pool serving each grid request with probability ``weight``; None if unstable."""
        share = weight.mean()
        if share == 0:
            return 0.0, math.inf
        if servers == 0:
            return None
        mean = (weight * times).sum() / weight.sum()
        scv = (weight * times**2).sum() / weight.sum() / mean**2 - 1
        lam = rate * share
        if lam * mean >= servers:
            return None
        return erlang_c(servers, lam * mean), (servers / mean - lam) * 2 / (1 + scv)

    def predict(self, fleet: Fleet, rate: float, *, percentiles: bool = True,
                remote_weight: np.ndarray | None = None) -> Prediction:
        """Predicted TTFT percentiles, TPOT, SLO attainment and link load of ``fleet`` at ``rate`` req/s.

        ``remote_weight``: per prompt-grid point, the probability of remote prefill (default: 1 above
        the fleet's threshold, else 0). ``percentiles=False`` skips the TTFT percentiles (NaN), for
        searches that need the attainment only.
        """
        if not 0 <= rate < math.inf:
            raise ValueError(f"rate must be a finite number of requests/s >= 0, got {rate!r}")
        sc, w = self.scenario, self.w
        if remote_weight is None:
            remote = np.zeros(len(w.n)) if fleet.threshold_tokens is None else (w.n > fleet.threshold_tokens) * 1.0
        else:
            remote = remote_weight
        link_bps = rate * (w.bytes * remote).mean()
        rho = link_bps / sc.link_bytes_per_s
        import_wait = 0.0
        if fleet.colocated:
            tpot, batch, t_local, import_wait = self._colocated(fleet.decode, rate, 1 - remote)
            local = self._pool(1 - remote, t_local, fleet.decode, rate) if not math.isnan(tpot) else None
        else:
            tpot, batch = self._decode(fleet.decode, rate)
            t_local = w.t_local
            local = self._pool(1 - remote, t_local, fleet.local_prefill, rate)
        far = self._pool(remote, w.t_remote, fleet.remote_prefill, rate)
        nan = float("nan")
        if local is None or far is None or rho >= 1 or math.isnan(tpot):
            return Prediction(rate, nan, nan, float(tpot), 0.0, float(link_bps * 8e-9), float(rho),
                              float(remote.mean()), float(batch))
        delay_far = w.t_remote + w.bytes / (sc.link_bytes_per_s * (1 - rho)) + sc.rtt_s + import_wait

        def ok(t: float, delay: np.ndarray, pool) -> np.ndarray:
            slack = t - delay
            with np.errstate(over="ignore", invalid="ignore"):
                done = np.where(slack >= 0, 1 - pool[0] * np.exp(-pool[1] * np.maximum(slack, 0)), 0.0)
            return np.nan_to_num(done, nan=1.0)

        def cdf(t: float) -> float:
            return float((remote * ok(t, delay_far, far) + (1 - remote) * ok(t, t_local, local)).mean())

        def quantile(q: float) -> float:
            lo, hi = 0.0, float(max(delay_far.max(), t_local.max())) + 1.0
            while cdf(hi) < q:
                hi *= 2
            for _ in range(50):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if cdf(mid) >= q else (mid, hi)
            return hi

        attainment = cdf(sc.ttft_slo_s) if tpot <= sc.tpot_slo_s else 0.0
        p50, p90 = (quantile(0.5), quantile(0.9)) if percentiles else (nan, nan)
        return Prediction(rate, p50, p90, float(tpot), attainment, float(link_bps * 8e-9), float(rho),
                          float(remote.mean()), float(batch))

    def _decode(self, replicas: int, rate: float) -> tuple[float, float]:
        """(TPOT s, mean batch) of the fluid decode model; (NaN, NaN) when over capacity."""
        p = self.scenario.profiles["bandwidth"]
        if replicas == 0:
            return float("nan"), float("nan")
        x = rate * self.w.mean_out / replicas
        gamma = self.w.decode_kv / p.decode_bytes_per_s
        beta = p.weight_bytes / p.decode_bytes_per_s
        per_seq = p.decode_compute_s_per_seq + p.decode_attention_s(self.w.decode_kv)
        if x * per_seq >= MAX_DECODE_UTILISATION or gamma * x >= 1:
            return float("nan"), float("nan")
        tpot = (beta + gamma) / (1 - gamma * x)
        batch = x * tpot
        if batch > self.scenario.max_num_seqs or batch * self.w.decode_kv > p.kv_capacity_bytes:
            return float("nan"), float("nan")
        return tpot, batch

    def _colocated(self, replicas: int, rate: float, local_weight: np.ndarray
                   ) -> tuple[float, float, np.ndarray, float]:
        """(TPOT s, mean decoding batch, per-grid local service time s, import wait s) of decode replicas that also
        prefill the local prompts (module docstring, "co-located local prefill"); TPOT NaN when over capacity.

        The import wait is the mean residual of the step in progress when a remotely prefilled request's KV
        arrives (its first token goes out once the replica has written it, between two steps): the residual of a
        renewal process, ``sum_k r_k E[S_k^2] / 2`` over step kinds of rate ``r_k`` (Kleinrock, "Queueing
        Systems" vol. 1, 1975, section 5.2), ``lambda_local / D * E[service^2] / 2`` for prompt steps and
        ``(1 - rho_p) * p * t_step(B) / 2`` for decode steps (deterministic, a share ``(1 - rho_p) * p`` of the
        time).
        """
        key = (replicas, rate, local_weight.tobytes())
        if key not in self._colocated_cache:
            if len(self._colocated_cache) >= COLOCATED_CACHE_SIZE:  # sizing searches repeat (replicas, rate) pairs
                self._colocated_cache.clear()
            self._colocated_cache[key] = self._solve_colocated(replicas, rate, local_weight)
        return self._colocated_cache[key]

    def _solve_colocated(self, replicas: int, rate: float, local_weight: np.ndarray
                         ) -> tuple[float, float, np.ndarray, float]:
        p = self.scenario.profiles["bandwidth"]
        nan = float("nan")
        t_alone, t_shared = self.w.t_local, p.colocated_prefill_time_s(self.w.n)
        if replicas == 0:
            return nan, nan, t_alone, nan
        x = rate * self.w.mean_out / replicas
        gamma = self.w.decode_kv / p.decode_bytes_per_s
        beta = p.weight_bytes / p.decode_bytes_per_s
        per_seq = p.decode_compute_s_per_seq + p.decode_attention_s(self.w.decode_kv)
        lam_local = rate * local_weight.mean() / replicas
        tpot, batch, service, rho_p, decoding = beta, 0.0, t_alone, 0.0, 0.0
        share = max(float(local_weight.mean()), 1e-300)
        for _ in range(FIXED_POINT_ITERATIONS):
            previous = tpot
            batch = x * tpot
            decoding = 1 - math.exp(-batch)
            extra = max(batch / decoding - 1, 0.0) if decoding > 0 else 0.0
            service = decoding * (t_shared + 1.5 * gamma * extra) + (1 - decoding) * t_alone
            rho_p = lam_local * float((local_weight * service).mean()) / share
            if rho_p >= 1 or x * per_seq >= MAX_DECODE_UTILISATION * (1 - rho_p):
                return nan, nan, service, nan
            tpot = 1 / ((1 - rho_p) / (beta + gamma * (1 + batch)) + lam_local)
            if abs(tpot - previous) <= 1e-13 * tpot:
                break
        batch = x * tpot
        if batch > self.scenario.max_num_seqs or batch * self.w.decode_kv > p.kv_capacity_bytes:
            return nan, nan, service, nan
        import_wait = (lam_local * float((local_weight * service**2).mean()) / share / 2
                       + (1 - rho_p) * decoding * (beta + gamma * (1 + batch)) / 2)
        return tpot, batch, service, import_wait

    # ------------------------------------------------------------------ sizing
    def size_fleet(self, threshold: int | None, rate: float, *, budget: float | None = None,
                   enforce_link_share: bool = True, colocated: bool = False) -> tuple[Fleet, Prediction] | None:
        """The fleet within ``budget`` (default the scenario's) that best meets the SLOs at ``rate``.

        Decode gets the fewest replicas meeting TPOT; the rest of the budget is split between remote
        and local prefill, trying every remote count and keeping the highest predicted attainment.
        ``colocated``: the decode replicas prefill the local prompts themselves (``Fleet.colocated``), so every
        split of the budget between remote prefill and decode replicas is tried instead.
        Returns None when no split meets the attainment (or the link share, if enforced).
        """
        sc = self.scenario
        budget = sc.budget if budget is None else budget
        if not -math.inf < budget < math.inf:
            raise ValueError(f"budget must be a finite cost, got {budget!r}")
        c_cost, b_cost = sc.profiles["compute"].cost, sc.profiles["bandwidth"].cost
        if colocated:
            # every split of the budget between remote prefill and decode replicas (which prefill locally too)
            remotes = [0] if threshold is None else range(1 if threshold == 0 else 0, int(budget // c_cost) + 1)
            fleets = [Fleet(r, 0, int((budget - r * c_cost) // b_cost), threshold, colocated=True) for r in remotes
                      if budget - r * c_cost >= b_cost]
            return self._best_fleet(fleets, rate, enforce_link_share)
        decode = 1
        while math.isnan(self._decode(decode, rate)[0]) or self._decode(decode, rate)[0] > sc.tpot_slo_s:
            decode += 1
            if decode * b_cost > budget:
                return None
        left = budget - decode * b_cost
        if threshold == 0:
            options = [(int(left // c_cost), 0)]
        elif threshold is None:
            options = [(0, int(left // b_cost))]
        else:
            options = [(r, int((left - r * c_cost) // b_cost)) for r in range(int(left // c_cost) + 1)]
        return self._best_fleet([Fleet(remote, local, decode, threshold) for remote, local in options], rate,
                                enforce_link_share)

    def _best_fleet(self, fleets: list[Fleet], rate: float, enforce_link_share: bool
                    ) -> tuple[Fleet, Prediction] | None:
        """The fleet of ``fleets`` with the highest predicted attainment at ``rate`` if it meets the scenario's, else
        None (also None when, enforced, the link share is passed: it depends on the rate and the threshold only,
        the same for every candidate)."""
        sc = self.scenario
        best = None
        for fleet in fleets:
            pred = self.predict(fleet, rate, percentiles=False)
            if enforce_link_share and pred.link_share > sc.max_link_share:
                return None
            if best is None or pred.attainment > best[1].attainment:
                best = (fleet, pred)
        if best is None or best[1].attainment < sc.slo_attainment:
            return None
        return best[0], self.predict(best[0], rate)

    def goodput(self, threshold: int | None, *, enforce_link_share: bool = True, budget: float | None = None,
                iterations: int = 30) -> tuple[float, Fleet | None, Prediction | None]:
        """Highest rate (req/s) a fleet sized by :meth:`size_fleet` serves within the SLOs (bisection)."""
        hi = 1.0
        while self.size_fleet(threshold, hi, budget=budget, enforce_link_share=enforce_link_share):
            hi *= 2
        lo, best = 0.0, None
        for _ in range(iterations):
            mid = (lo + hi) / 2
            found = self.size_fleet(threshold, mid, budget=budget, enforce_link_share=enforce_link_share)
            if found:
                lo, best = mid, found
            else:
                hi = mid
        return (lo, *best) if best else (0.0, None, None)

    def best_threshold(self, thresholds) -> tuple[int, float, Fleet, Prediction, list[tuple[int, float]]]:
        """The threshold of ``thresholds`` with the highest predicted goodput (link share enforced).

        Returns ``(threshold, goodput, fleet, prediction, [(threshold, goodput), ...])``.

        Raises:
            ValueError: no threshold has a positive goodput.
        """
        curve, best = [], None
        for t in thresholds:
            rate, fleet, pred = self.goodput(int(t), iterations=16)
            curve.append((int(t), rate))
            if fleet is not None and (best is None or rate > best[1]):
                best = (int(t), rate, fleet, pred)
        if best is None:
            raise ValueError("no threshold meets the SLOs within the budget")
        return (*best, curve)

    def link_limited_remote_replicas(self, threshold: int) -> int:
        """Fewest remote prefill replicas whose KV output, all busy on prompts above ``threshold``, fills the link share.

        A busy replica ships ``E[bytes(N); N > T] / E[t_prefill(N); N > T]`` bytes/s; the link may carry
        ``max_link_share * B``. Returns the ceiling of the ratio (0 when no prompt is above ``threshold``): a
        pool one replica larger than the floor is still fed (below capacity) by the link share, which
        :meth:`bandwidth_aware_weights` throttles, and where one busy replica alone ships more than the share
        (10 Gbit/s; a dense model) the floor would rule remote prefill out entirely.
        """
        w, sc = self.w, self.scenario
        mask = w.n > threshold
        if not mask.any():
            return 0
        return math.ceil(sc.max_link_share * sc.link_bytes_per_s / (w.bytes[mask].sum() / w.t_remote[mask].sum()))

    def bandwidth_aware_weights(self, fleet: Fleet, rate: float, low_tokens: int,
                                high_tokens: int | None = None) -> np.ndarray:
        """Remote probability per grid prompt under bandwidth-aware routing with bounds ``low_tokens``, ``high_tokens``.

        Prompts above ``high_tokens`` always go remote (the router's upper bound; None: no upper bound).
        Prompts in ``(low, high]`` go remote with probability ``f = min(1, f_link, f_pool)`` (at least 0):
        the link budget left by the forced ones carries ``f_link = (max_link_share * B - lambda *
        E[bytes; N > high]) / (lambda * E[bytes; low < N <= high])`` of their KV, and the remote pool stays
        under ``MAX_DECODE_UTILISATION`` (``f_pool = (u R - lambda E[t_remote; N > high]) / (lambda
        E[t_remote; low < N <= high])``; the router's queue-aware rule sends prompts local when the remote
        queue grows).
        """
        w, sc = self.w, self.scenario
        if fleet.remote_prefill == 0:
            return np.zeros(len(w.n))
        forced = (w.n > high_tokens) * 1.0 if high_tokens is not None else np.zeros(len(w.n))
        tail = (w.n > low_tokens) * (1.0 - forced)
        demand_bytes = rate * (w.bytes * tail).mean()
        demand_s = rate * (w.t_remote * tail).mean()
        if demand_bytes == 0:
            return forced
        f = min(1.0, (sc.max_link_share * sc.link_bytes_per_s - rate * (w.bytes * forced).mean()) / demand_bytes,
                (MAX_DECODE_UTILISATION * fleet.remote_prefill - rate * (w.t_remote * forced).mean()) / demand_s)
        return forced + tail * max(f, 0.0)

    def plan_bandwidth_aware(self, thresholds) -> tuple[int, float, Fleet, Prediction]:
        """Central threshold ``T``, remote replicas and the rest of the fleet for bandwidth-aware routing.

        For each ``T`` of ``thresholds`` (bounds ``low * T`` and ``high * T``, the scenario's) and each remote
        pool from 0 to the larger of :meth:`link_limited_remote_replicas` at ``low`` and at ``T`` replicas, the rate is bisected on the
        prediction with :meth:`bandwidth_aware_weights` (attainment met and the link share at most
        ``max_link_share``); decode gets the fewest replicas meeting TPOT, local prefill the rest of the
        budget. Returns the best ``(T, goodput, fleet, prediction)``.

        Raises:
            ValueError: no combination meets the SLOs.
        """
        sc = self.scenario
        best = None
        for t in thresholds:
            low, high = int(sc.threshold_bounds[0] * t), int(sc.threshold_bounds[1] * t)
            # Up to the pool the link feeds at the central threshold as well as at the lower bound: at T the
            # prompts sent are longer, so a busy replica ships less KV per second and the link feeds more of them
            # (capped at the lower bound, 8 replicas were tried where a fixed threshold at T used 9).
            most = max(self.link_limited_remote_replicas(low), self.link_limited_remote_replicas(int(t)))
            for remote in range(most + 1):
                lo, hi, found = 0.0, 2 * sc.budget, None
                for _ in range(20):
                    mid = (lo + hi) / 2
                    got = self._bandwidth_aware_fleet(mid, int(t), low, high, remote)
                    lo, hi, found = (mid, hi, (got, mid)) if got else (lo, mid, found)
                if found and (best is None or found[1] > best[1][1]):
                    best = (int(t), found)
        if best is None:
            raise ValueError("no bandwidth-aware fleet meets the SLOs within the budget")
        t, (fleet, rate) = best
        low, high = int(sc.threshold_bounds[0] * t), int(sc.threshold_bounds[1] * t)
        return t, rate, fleet, self.predict(fleet, rate,
                                            remote_weight=self.bandwidth_aware_weights(fleet, rate, low, high))

    def _bandwidth_aware_fleet(self, rate: float, threshold: int, low: int, high: int, remote: int) -> Fleet | None:
        """The bandwidth-aware fleet with ``remote`` replicas if it meets the SLOs at ``rate``, else None."""
        sc = self.scenario
        c_cost, b_cost = sc.profiles["compute"].cost, sc.profiles["bandwidth"].cost
        decode = next((d for d in range(1, int(sc.budget // b_cost) + 1)
                       if self._decode(d, rate)[0] <= sc.tpot_slo_s), None)
        if decode is None:
            return None
        fleet = Fleet(remote, int((sc.budget - remote * c_cost - decode * b_cost) // b_cost), decode, threshold)
        pred = self.predict(fleet, rate, percentiles=False,
                            remote_weight=self.bandwidth_aware_weights(fleet, rate, low, high))
        # prompts above the upper bound go remote whatever the link: their KV alone may pass the share
        link_ok = pred.link_share <= sc.max_link_share * (1 + 1e-9)
        return fleet if pred.attainment >= sc.slo_attainment and link_ok else None
