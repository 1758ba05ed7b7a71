"""Discrete-event simulator (``simpy``) of a prefill/decode fleet across two datacenters.

Model and fidelity, exactly:

- Costs are :class:`~inference_worker.planning.profiles.RooflineProfile`'s: a replica is a scenario's
  ``accelerators_per_replica`` accelerators (``prfaas``: one node of 8, tensor parallel at the same
  utilisation, ASSUMED: on one H20 a 32K prompt takes 36 s, past the 5 s TTFT objective; on a node 4.5 s,
  on an H200 node 0.68 s); prefill FLOPs are ``2 P N`` (Kaplan et al. 2020) plus attention
  (``4 n_q d_head`` per query-key pair per layer, PaLM appendix B; quadratic on full layers, capped at
  ``W`` keys on sliding ones) at the scenario's share of peak FLOP/s; a decode iteration is the roofline
  maximum of its weight and attention FLOPs and its weight plus resident-KV bytes (full and sliding
  layers, the catalog's one KV formula). KV shipped: ``KVLayout.transfer_bytes`` (full layers ``N``
  tokens, sliding layers ``min(N, W - 1)``).
- Homogeneous PD runs on :meth:`Scenario.homogeneous`: both pools on one accelerator type in one
  datacenter (either type; the caller compares them).
- Requests arrive as given (Poisson in scenarios); a policy (:mod:`.policies`) picks local or remote
  prefill at arrival.
- Prefill pools: ``simpy.Resource`` FIFO queues; a replica prefills one prompt at a time for
  ``profile.prefill_time_s(N)`` (no chunking, no batching of prefills).
- KV transfer (remote prefills only) over one link shared as egalitarian processor sharing: ``n``
  concurrent transfers each get ``B / n`` (exact, event-driven, via a virtual-time heap), then RTT.
  Local (intra-datacenter) hand-offs are instantaneous. The first token is produced by the prefill;
  TTFT ends when its KV has reached the decode datacenter.
- Decode replicas: continuous batching, one iteration = ``profile.decode_step_s(B, kv_bytes)`` with the
  batch ``B`` and its resident KV. Sequences join at iteration boundaries when ``B < max_num_seqs`` and
  their final KV (``resident_bytes(N + out)``) fits the replica's KV capacity (reserved at admission,
  no preemption); a request goes to the less loaded of two random replicas (power of two choices).
  Between events a replica advances by whole iterations with the step time of the span's first
  iteration (a sequence's KV grows linearly from ``resident_bytes(N)`` to ``resident_bytes(N + out)``,
  updated at each event): the event count is bounded by admissions and finishes, not tokens.
- TPOT of a request: ``(last token - first token) / (out - 1)`` (decode queueing included).
- Goodput counts a rate only when the run is stable: no queue (link, either prefill pool) is at once
  offered over 105% of its capacity, backlogged past the TTFT objective when the last request arrives,
  and grown over the second half of the arrivals by more than 5% of that half's duration (decode is
  not checked: it is sized with headroom and its backlog shows in TPOT). The growth test tells an
  overloaded queue (backlog ~ (rho - 1) x time) from one a queue-aware router keeps full: a bounded
  backlog of b seconds reads as offered ``1 + b / span``, over 1.05 in runs shorter than ``20 b``.
- The router's link budget (bandwidth-aware policy): a token bucket refilled at
  ``max_link_share * B`` bytes/s, one second deep; a remote decision drains it by the KV bytes.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np
import simpy

from inference_worker.planning.planner import Fleet
from inference_worker.planning.policies import Policy
from inference_worker.planning.scenario import Scenario
from inference_worker.planning.workload import poisson_arrivals

LINK_WINDOW_S = 1.0
OVERLOAD = 1.05  # offered load (work / capacity over the arrival span) above which a backlogged queue is unstable


class Link:
    """A link shared by processor sharing: ``send(nbytes)`` returns an event fired at delivery."""

    def __init__(self, env: simpy.Environment, bytes_per_s: float):
        self.env, self.bytes_per_s = env, bytes_per_s
        self.virtual = 0.0  # bytes each active flow has received since the start
        self.updated = 0.0
        self.flows: list[tuple[float, int, simpy.Event]] = []  # (virtual finish, seq, event)
        self.seq = 0
        self.bytes_total = 0.0
        self._wake = env.event()
        env.process(self._run())

    def _advance(self) -> None:
        now = self.env.now
        if self.flows:
            self.virtual += (now - self.updated) * self.bytes_per_s / len(self.flows)
        self.updated = now

    def send(self, nbytes: float) -> simpy.Event:
        """Start a transfer of ``nbytes``; the event fires when it is delivered."""
        self._advance()
        event = self.env.event()
        self.seq += 1
        heapq.heappush(self.flows, (self.virtual + nbytes, self.seq, event))
        self.bytes_total += nbytes
        if not self._wake.triggered:
            self._wake.succeed()
        return event

    def _run(self):
        while True:
            if not self.flows:
                self._wake = self.env.event()
                yield self._wake
                continue
            dt = (self.flows[0][0] - self.virtual) * len(self.flows) / self.bytes_per_s
            self._wake = self.env.event()
            yield self.env.timeout(max(dt, 0.0)) | self._wake
            self._advance()
            while self.flows and self.flows[0][0] <= self.virtual * (1 + 1e-12) + 1e-6:
                heapq.heappop(self.flows)[2].succeed()


class PrefillPool:
    """FIFO prefill replicas of one profile; tracks queued work for wait estimates."""

    def __init__(self, env: simpy.Environment, replicas: int, profile):
        self.replicas, self.profile = replicas, profile
        self.resource = simpy.Resource(env, capacity=max(replicas, 1))
        self.queued_s = 0.0
        self.offered_s = 0.0
        self._service: dict[int, float] = {}

    def service_s(self, num_tokens: int) -> float:
        """``profile.prefill_time_s(num_tokens)``, memoised (the roofline's attention sum is not free)."""
        t = self._service.get(num_tokens)
        if t is None:
            t = self._service[num_tokens] = float(self.profile.prefill_time_s(num_tokens))
        return t

    def wait_s(self) -> float:
        """Estimated queue wait: queued prefill seconds / replicas, 0 while a replica is free."""
        if self.replicas == 0:
            return math.inf
        return self.queued_s / self.replicas if self.resource.count >= self.replicas else 0.0


class DecodeReplica:
    """Continuous batching on one decode replica (see the module docstring for the fidelity)."""

    def __init__(self, sim: Simulation):
        self.sim, self.env = sim, sim.env
        self.waiting: list[int] = []
        self.finish_at: list[tuple[int, int]] = []  # heap of (finish iteration, request)
        self.iterations = 0
        self.kv_bytes = 0.0
        self.kv_slope = 0.0  # bytes the batch's KV grows per iteration
        self.kv_reserved = 0.0
        self._wake = self.env.event()
        self.env.process(self._run())

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.finish_at)

    def submit(self, i: int) -> None:
        self.waiting.append(i)
        if not self._wake.triggered:
            self._wake.succeed()

    def _admit(self) -> None:
        sim = self.sim
        while self.waiting and len(self.finish_at) < sim.max_num_seqs:
            i = self.waiting[0]
            if self.finish_at and self.kv_reserved + sim.kv_final[i] > sim.kv_capacity:
                break
            self.waiting.pop(0)
            heapq.heappush(self.finish_at, (self.iterations + int(sim.out[i]) - 1, i))
            self.kv_bytes += sim.kv_start[i]
            self.kv_slope += sim.kv_slope[i]
            self.kv_reserved += sim.kv_final[i]

    def _run(self):
        env, sim = self.env, self.sim
        while True:
            self._admit()
            if not self.finish_at:
                self._wake = env.event()
                yield self._wake
                continue
            step = sim.decode_profile.decode_step_s(len(self.finish_at), self.kv_bytes)
            todo = self.finish_at[0][0] - self.iterations
            start = env.now
            self._wake = env.event()
            if todo > 0:
                yield env.timeout(todo * step) | self._wake
            done = todo
            elapsed = env.now - start
            if done > 0 and elapsed < todo * step * (1 - 1e-12):
                done = min(todo, int(elapsed / step) + 1)
                yield env.timeout(max(done * step - elapsed, 0.0))
            self.iterations += done
            self.kv_bytes += done * self.kv_slope
            while self.finish_at and self.finish_at[0][0] <= self.iterations:
                _, i = heapq.heappop(self.finish_at)
                sim.last_token[i] = env.now
                self.kv_bytes -= sim.kv_start[i] + (sim.out[i] - 1) * sim.kv_slope[i]
                self.kv_slope -= sim.kv_slope[i]
                self.kv_reserved -= sim.kv_final[i]


@dataclass(frozen=True)
class SimResult:
    """Per-run outcome; ``summary()`` gives the figures the bench prints."""

    rate_per_s: float
    """Arrival rate of the run, requests/s (NaN if not given)."""
    ttft_s: np.ndarray
    """Per request: TTFT, seconds."""
    tpot_s: np.ndarray
    """Per request: TPOT, seconds per output token (0 for one-token outputs)."""
    remote: np.ndarray
    """Per request: prefilled remotely."""
    link_bytes: float
    """KV bytes sent over the link."""
    duration_s: float
    """Simulated time until the last token, seconds."""
    link_gbps: float
    """Link bandwidth, Gbit/s."""
    wall_s: float
    """Wall-clock seconds the run took."""
    offered_load: dict
    """Per resource (``link``, ``local_prefill``, ``remote_prefill``): work offered over the arrival span
    divided by its capacity (link bytes / (B * span); prefill seconds / (replicas * span))."""
    backlog_s: dict
    """Per resource, when the last request arrives: seconds to drain its queue (link bytes in flight / B;
    queued prefill seconds / replicas)."""
    ttft_slo_s: float
    """The TTFT objective the run was judged against (the stability bound)."""
    events: int
    """simpy events scheduled (a private counter of simpy 4.1; for the cost report only)."""
    backlog_mid_s: dict
    """``backlog_s`` when the middle request (index ``n // 2``) arrives."""
    second_half_s: float
    """Seconds from the middle request's arrival to the last one's."""

    @property
    def stable(self) -> bool:
        """No queue is at once offered more than ``OVERLOAD`` of its capacity, backlogged past the TTFT objective
        at the last arrival, and grown over the second half of the arrivals by more than ``OVERLOAD - 1`` of
        that half's seconds.

        An overloaded queue's backlog grows with the run, so all three hold. Each alone is noise: a stable
        queue's backlog at one instant can exceed 5 s near capacity, and a queue that bandwidth-aware routing
        keeps full has a bounded backlog ``b`` that reads as offered ``1 + b / span`` (1.056 with ``b`` = 16 s
        over a 312 s run of ``prfaas``) but does not grow.
        """
        return not any(self.offered_load[k] > OVERLOAD and self.backlog_s[k] > self.ttft_slo_s
                       and self.backlog_s[k] - self.backlog_mid_s[k] > (OVERLOAD - 1) * self.second_half_s
                       for k in self.offered_load)

    def attainment(self, scenario: Scenario) -> float:
        """Share of requests with TTFT <= the TTFT objective and TPOT <= the TPOT objective."""
        ok = (self.ttft_s <= scenario.ttft_slo_s) & (self.tpot_s <= scenario.tpot_slo_s)
        return float(ok.mean())

    def summary(self, scenario: Scenario) -> dict:
        """Rate, attainment, TTFT p50/p90, TPOT p50/p90, link share, remote share, wall time."""
        return {
            "rate_per_s": self.rate_per_s, "attainment": self.attainment(scenario),
            "ttft_p50_s": float(np.percentile(self.ttft_s, 50)), "ttft_p90_s": float(np.percentile(self.ttft_s, 90)),
            "tpot_p50_s": float(np.percentile(self.tpot_s, 50)), "tpot_p90_s": float(np.percentile(self.tpot_s, 90)),
            "link_share": self.link_bytes * 8 / (self.link_gbps * 1e9 * self.duration_s),
            "remote_share": float(self.remote.mean()), "wall_s": self.wall_s, "events": self.events,
            "offered_load": self.offered_load, "backlog_s": self.backlog_s,
        }


class Simulation:
    """One run of ``policy`` on ``fleet`` with the given requests (arrival s, prompt and output tokens)."""

    def __init__(self, scenario: Scenario, fleet: Fleet, policy: Policy, arrivals: np.ndarray,
                 prompt_tokens: np.ndarray, output_tokens: np.ndarray, seed: int = 0):
        if fleet.decode < 1:
            raise ValueError("a fleet needs at least one decode replica")
        self.scenario, self.fleet, self.policy = scenario, fleet, policy
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(seed)
        self.arrivals, self.n, self.out = arrivals, prompt_tokens, np.maximum(output_tokens, 1)
        geo, cap = scenario.geometry, int(prompt_tokens.max() + self.out.max())
        self.kv_start = geo.resident_bytes_array(self.n, cap)
        self.kv_final = geo.resident_bytes_array(self.n + self.out, cap)
        self.kv_slope = (self.kv_final - self.kv_start) / self.out
        self.xfer_bytes = geo.transfer_bytes_array(self.n, cap)
        self.decode_profile = scenario.profiles["bandwidth"]
        self.kv_capacity = self.decode_profile.kv_capacity_bytes
        self.max_num_seqs = scenario.max_num_seqs
        self.local = PrefillPool(self.env, fleet.local_prefill, scenario.profiles["bandwidth"])
        self.far = PrefillPool(self.env, fleet.remote_prefill, scenario.profiles["compute"])
        self.link = Link(self.env, scenario.link_bytes_per_s)
        self.decoders = [DecodeReplica(self) for _ in range(fleet.decode)]
        self.first_token = np.full(len(arrivals), np.nan)
        self.last_token = np.full(len(arrivals), np.nan)
        self.is_remote = np.zeros(len(arrivals), bool)
        self._xfer: dict[int, float] = {}
        self._bucket, self._bucket_t = scenario.max_link_share * self.link.bytes_per_s * LINK_WINDOW_S, 0.0

    # SystemView for the policies
    def local_wait_s(self) -> float:
        return self.local.wait_s()

    def remote_wait_s(self) -> float:
        return self.far.wait_s()

    def local_prefill_s(self, num_tokens: int) -> float:
        return self.local.service_s(num_tokens) if self.fleet.local_prefill else math.inf

    def remote_prefill_s(self, num_tokens: int) -> float:
        return self.far.service_s(num_tokens) if self.fleet.remote_prefill else math.inf

    def _transfer_bytes(self, num_tokens: int) -> float:
        nbytes = self._xfer.get(num_tokens)
        if nbytes is None:
            nbytes = self._xfer[num_tokens] = self.scenario.geometry.transfer_bytes(int(num_tokens))
        return nbytes

    def transfer_eta_s(self, num_tokens: int) -> float:
        nbytes = self._transfer_bytes(num_tokens)
        return nbytes * (len(self.link.flows) + 1) / self.link.bytes_per_s + self.scenario.rtt_s

    def _refill(self) -> None:
        rate = self.scenario.max_link_share * self.link.bytes_per_s
        now = self.env.now
        self._bucket = min(rate * LINK_WINDOW_S, self._bucket + (now - self._bucket_t) * rate)
        self._bucket_t = now

    def link_budget_allows(self, num_tokens: int) -> bool:
        """Token bucket at ``max_link_share * B`` bytes/s, depth one second: allow (and spend) while not overdrawn."""
        self._refill()
        if self._bucket < 0:
            return False
        self._bucket -= self._transfer_bytes(num_tokens)
        return True

    def link_budget_spend(self, num_tokens: int) -> None:
        """Spend a forced remote transfer's bytes from the bucket (it may go negative and gate later ones)."""
        self._refill()
        self._bucket -= self._transfer_bytes(num_tokens)

    def _request(self, i: int):
        n = int(self.n[i])
        remote = self.policy.remote(n, self)
        if remote and self.fleet.remote_prefill == 0 or not remote and self.fleet.local_prefill == 0:
            remote = not remote  # the policy's pool does not exist in this fleet
        self.is_remote[i] = remote
        pool = self.far if remote else self.local
        service = pool.service_s(n)
        pool.queued_s += service
        pool.offered_s += service
        with pool.resource.request() as req:
            req.service_s = service
            yield req
            pool.queued_s -= service
            yield self.env.timeout(service)
        if remote:
            yield self.link.send(self.xfer_bytes[i])
            yield self.env.timeout(self.scenario.rtt_s)
        self.first_token[i] = self.env.now
        if self.out[i] <= 1:
            self.last_token[i] = self.env.now
            return
        a, b = self.rng.integers(len(self.decoders), size=2)
        da, db = self.decoders[a], self.decoders[b]
        (da if da.load <= db.load else db).submit(i)

    def _backlog(self) -> dict:
        """Per queue, seconds to drain what waits now (link bytes in flight / B; queued prefill s / replicas)."""
        self.link._advance()
        waiting = {pool: sum(r.service_s for r in pool.resource.queue) for pool in (self.local, self.far)}
        return {"link": sum(f - self.link.virtual for f, _, _ in self.link.flows) / self.link.bytes_per_s,
                "local_prefill": waiting[self.local] / max(self.local.replicas, 1),
                "remote_prefill": waiting[self.far] / max(self.far.replicas, 1)}

    def _source(self):
        now, middle = 0.0, len(self.arrivals) // 2
        for i, t in enumerate(self.arrivals):
            yield self.env.timeout(t - now)
            now = t
            self.env.process(self._request(i))
            if i == middle:
                yield self.env.timeout(0)  # the middle request has joined its queue
                self.backlog_mid_s, self.middle_t = self._backlog(), t
        yield self.env.timeout(0)  # the last request has joined its queue
        self.backlog_s = self._backlog()

    def run(self, rate_per_s: float = float("nan")) -> SimResult:
        """Run until every request has finished; raises RuntimeError if one never does."""
        started = time.perf_counter()
        self.env.process(self._source())
        self.env.run()
        if np.isnan(self.last_token).any():
            raise RuntimeError("some requests never finished (a decode replica cannot hold their KV)")
        tpot = np.where(self.out > 1, (self.last_token - self.first_token) / np.maximum(self.out - 1, 1), 0.0)
        duration = float(np.nanmax(self.last_token))
        span = float(self.arrivals[-1]) or 1e-9
        offered = {"link": self.link.bytes_total / (self.link.bytes_per_s * span),
                   "local_prefill": self.local.offered_s / (max(self.local.replicas, 1) * span),
                   "remote_prefill": self.far.offered_s / (max(self.far.replicas, 1) * span)}
        return SimResult(rate_per_s, self.first_token - self.arrivals, tpot, self.is_remote, self.link.bytes_total,
                         duration, self.scenario.bandwidth_gbps, time.perf_counter() - started, offered,
                         self.backlog_s, self.scenario.ttft_slo_s, next(self.env._eid), self.backlog_mid_s,
                         float(self.arrivals[-1]) - self.middle_t)


def simulate(scenario: Scenario, fleet: Fleet, policy: Policy, rate_per_s: float, num_requests: int,
             seed: int = 0) -> SimResult:
    """Simulate ``num_requests`` Poisson arrivals at ``rate_per_s`` drawn from the scenario's workload."""
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate_per_s, num_requests)
    prompts = scenario.prompt.sample(rng, num_requests)
    outputs = scenario.output.sample(rng, num_requests)
    return Simulation(scenario, fleet, policy, arrivals, prompts, outputs, seed).run(rate_per_s)


def simulated_goodput(scenario: Scenario, fleet: Fleet, policy: Policy, *, num_requests: int, hi_rate: float,
                      iterations: int = 8, seed: int = 0) -> tuple[float, SimResult | None]:
    """Highest stable rate with SLO attainment >= ``scenario.slo_attainment`` (bisection on ``[0, hi_rate]``).

    Stable (:attr:`SimResult.stable`): no queue offered over 105% of its capacity, backlogged past the TTFT
    objective when the last request arrives and grown over the second half of the arrivals. Without it a policy
    could "meet" 90% attainment by starving a class of up to 10% of the requests in an ever-growing
    queue (a fixed threshold on an overloaded link did, in a short run).

    Returns the rate and the run at that rate (None if even the lowest rate tried misses the SLOs).
    """
    lo, best = 0.0, None
    hi = hi_rate
    for _ in range(iterations):
        mid = (lo + hi) / 2
        result = simulate(scenario, fleet, policy, mid, num_requests, seed)
        if result.stable and result.attainment(scenario) >= scenario.slo_attainment:
            lo, best = mid, result
        else:
            hi = mid
    return lo, best
