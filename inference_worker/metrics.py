"""Prometheus metrics of a Ferry worker, following DESIGN's metrics contract.

Names carry the ``ferry_`` prefix; every series carries the worker's identity labels
(:data:`WORKER_LABELS`: model, model_version, role, pool, track, replica). Counters end in
``_total``, durations in ``_seconds``, sizes in ``_bytes``; ratios are gauges in 0..1.

Each server builds its own :class:`prometheus_client.CollectorRegistry` (never the global
default), so several workers can live in one test process and ``/metrics`` shows only this
worker's series.

The KV transfer metrics are defined here, with their final names and labels, so the
disaggregation work (sender/receiver) only increments them:

- ``ferry_kv_transfer_total{direction, outcome, reason}``: transfers finished, ``direction``
  send | receive, ``outcome`` success | failure, ``reason`` one of :data:`KV_TRANSFER_REASONS`
  (``none`` for successes).
- ``ferry_kv_transfer_raw_bytes_total`` / ``ferry_kv_transfer_wire_bytes_total{direction}``: KV
  payload bytes before compression and bytes actually on the wire (compressed, framed).
- ``ferry_kv_transfer_seconds{direction}``: wall time of one transfer, histogram.
- ``ferry_kv_connections_dropped_total{reason}``: KV receiver connections closed because the peer lied
  (bad magic or protocol, a length over the model's KV geometry, a header tag that does not verify, an
  unauthenticated protocol-2 header that names no waiting request); ``reason`` as above. The frame is
  also counted on ``ferry_kv_transfer_total`` as a receive failure.
- ``ferry_kv_recompute_total{reason}``: decode-side prefills recomputed locally after a failed KV
  hand-off, by the failure reason.

Request lengths, histograms in tokens, observed once per finished choice where the request is answered (the
decode or co-located worker, whether its prompt was prefilled here or on a prefill worker), so one pool's series
describe all of its traffic: ``ferry_request_prompt_tokens`` (the whole prompt),
``ferry_request_computed_prompt_tokens`` (the prompt tokens no prefix cache held: computed here or by the prefill
worker) and ``ferry_request_generation_tokens``. A profiling sweep's requests (header ``x-ferry-profiling``) are
left out of these and of the latency histograms: they are the control plane's measurement, not the clients' traffic. The capacity planner reads their quantiles as "last hour's
traffic" (``apps.planning.selectors.telemetry_workload``); vLLM exports the first and last under
``vllm:request_prompt_tokens`` / ``vllm:request_generation_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WORKER_LABELS = ("model", "model_version", "role", "pool", "track", "replica")
"""Identity labels on every worker series (DESIGN, "Metrics contract")."""

REQUEST_OUTCOMES = ("success", "client_error", "server_error", "aborted", "rejected")
"""Values of ``outcome`` on ``ferry_requests_total``: success (finished normally), client_error
(4xx: invalid request), server_error (5xx, including injected faults), aborted (client went away
or drain timed out), rejected (503 while draining). Rollout gates take server_error as errors."""

KV_TRANSFER_REASONS = ("none", "timeout", "connection", "checksum", "truncated", "auth", "version_mismatch",
                       "protocol", "capacity", "late", "unexpected")
"""Values of ``reason`` on ``ferry_kv_transfer_total`` (``none`` for successes; the others are the
``reason`` of :mod:`inference_worker.kv_transfer.errors`' classes) and on ``ferry_kv_recompute_total``."""

# Latency buckets, seconds: cover fast GPU decode (ms) up to slow CPU prefill (tens of seconds).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                     1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Token-count buckets: 1 to 256K in steps of 2 and 1.5 (1, 2, 3, 4, 6, 8, 12, ...), so an interpolated quantile is
# within a third of a bucket of the truth from one-token replies to long-context prompts.
TOKEN_BUCKETS = (1, *sorted(m << e for e in range(18) for m in (2, 3) if m << e <= 262144))
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0,
                 300.0)


@dataclass(frozen=True)
class KVTransferMetrics:
    """KV transfer series (see the module docstring); label with ``.labels(**identity, ...)``."""

    transfers: Counter
    raw_bytes: Counter
    wire_bytes: Counter
    seconds: Histogram
    dropped: Counter


def kv_transfer_metrics(registry: CollectorRegistry, labelnames: tuple[str, ...] = WORKER_LABELS) -> KVTransferMetrics:
    """Register the KV transfer metrics on ``registry`` and return them."""
    return KVTransferMetrics(
        transfers=Counter(
            "ferry_kv_transfer", "KV cache transfers finished, by direction, outcome and failure reason.",
            [*labelnames, "direction", "outcome", "reason"], registry=registry,
        ),
        raw_bytes=Counter(
            "ferry_kv_transfer_raw_bytes", "KV payload bytes transferred before compression.",
            [*labelnames, "direction"], registry=registry,
        ),
        wire_bytes=Counter(
            "ferry_kv_transfer_wire_bytes", "KV transfer bytes on the wire (compressed and framed).",
            [*labelnames, "direction"], registry=registry,
        ),
        seconds=Histogram(
            "ferry_kv_transfer_seconds", "Wall time of one KV cache transfer.",
            [*labelnames, "direction"], buckets=LATENCY_BUCKETS_S, registry=registry,
        ),
        dropped=Counter(
            "ferry_kv_connections_dropped", "KV receiver connections dropped because the peer lied, by reason.",
            [*labelnames, "reason"], registry=registry,
        ),
    )


class WorkerMetrics:
    """All series of one worker, bound to its identity labels.

    Args:
        identity: values for :data:`WORKER_LABELS`; missing labels are exported as "".
        registry: where to register; a fresh registry when omitted.
        gpu: also export GPU utilization/memory gauges (only pass True when a GPU exists).

    Raises:
        ValueError: ``identity`` has a key outside :data:`WORKER_LABELS`.
    """

    def __init__(self, identity: Mapping[str, str], registry: CollectorRegistry | None = None, *, gpu: bool = False):
        unknown = set(identity) - set(WORKER_LABELS)
        if unknown:
            raise ValueError(f"unknown metric labels {sorted(unknown)}; allowed: {WORKER_LABELS}")
        self.identity = {name: str(identity.get(name, "")) for name in WORKER_LABELS}
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, WORKER_LABELS
        self._waiting = Gauge("ferry_num_requests_waiting", "Requests queued, not yet scheduled.", labels, registry=r)
        self._running = Gauge("ferry_num_requests_running", "Requests in the running batch.", labels, registry=r)
        self._requests = Counter(
            "ferry_requests",
            "Completion (and, on a prefill worker, internal prefill) requests finished, by outcome (see REQUEST_OUTCOMES).",
            [*labels, "outcome"], registry=r,
        )
        self._prompt_tokens = Counter("ferry_prompt_tokens", "Prompt tokens prefilled.", labels, registry=r)
        self._generation_tokens = Counter("ferry_generation_tokens", "Tokens generated.", labels, registry=r)
        self._ttft = Histogram(
            "ferry_time_to_first_token_seconds", "Time from request arrival to its first generated token.",
            labels, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self._tpot = Histogram(
            "ferry_time_per_output_token_seconds",
            "Per request: (e2e latency - TTFT) / (output tokens - 1); requests with one token are skipped.",
            labels, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self._e2e = Histogram(
            "ferry_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            labels, buckets=E2E_BUCKETS_S, registry=r,
        )
        self._prompt_lengths = Histogram(
            "ferry_request_prompt_tokens", "Prompt tokens of a finished request (per choice), cached ones included.",
            labels, buckets=TOKEN_BUCKETS, registry=r,
        )
        self._computed_lengths = Histogram(
            "ferry_request_computed_prompt_tokens",
            "Prompt tokens of a finished request (per choice) that no prefix cache held: computed here or by the "
            "prefill worker.", labels, buckets=TOKEN_BUCKETS, registry=r,
        )
        self._generation_lengths = Histogram(
            "ferry_request_generation_tokens", "Tokens generated for a finished request (per choice).",
            labels, buckets=TOKEN_BUCKETS, registry=r,
        )
        self._kv_usage = Gauge(
            "ferry_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", labels, registry=r,
        )
        self._busy = Gauge(
            "ferry_engine_busy_ratio",
            "Fraction of recent wall time the engine spent stepping (0..1); the CPU substitute for GPU "
            "utilization, not a GPU figure.",
            labels, registry=r,
        )
        self._ready = Gauge("ferry_worker_ready", "1 when the worker accepts requests, 0 while loading or draining.",
                            labels, registry=r)
        self._gpu_util = self._gpu_mem = None
        if gpu:
            self._gpu_util = Gauge("ferry_gpu_utilization_ratio", "GPU utilization from NVML (0..1).", labels,
                                   registry=r)
            self._gpu_mem = Gauge("ferry_gpu_memory_used_bytes", "GPU memory in use on the device.", labels,
                                  registry=r)
        self.kv_transfer = kv_transfer_metrics(r)
        self._kv_recompute = Counter(
            "ferry_kv_recompute", "Prefills recomputed on the decode worker after a failed KV hand-off, by reason.",
            [*labels, "reason"], registry=r,
        )
        self._prefix_queries = Counter(
            "ferry_prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.", labels,
            registry=r)
        self._prefix_hits = Counter(
            "ferry_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).", labels, registry=r)
        self._prefix_evictions = Counter(
            "ferry_prefix_cache_evictions", "Cached KV blocks whose memory was reused, by KV-cache group.",
            [*labels, "group"], registry=r)
        self._prefix_blocks = Gauge(
            "ferry_prefix_cache_blocks", "KV blocks registered in the prefix cache (reusable), by KV-cache group.",
            [*labels, "group"], registry=r)
        tier_labels = [*labels, "tier"]
        self._tier_counters = {
            "hit_tokens": Counter("ferry_kv_tier_hits", "Prompt tokens loaded from a KV tier (not computed).",
                                  tier_labels, registry=r),
            "read_bytes": Counter("ferry_kv_tier_read_bytes", "Bytes of KV tier entries read.", tier_labels, registry=r),
            "written_bytes": Counter("ferry_kv_tier_written_bytes", "Bytes of KV tier entries written.", tier_labels,
                                     registry=r),
            "load_seconds": Counter("ferry_kv_tier_load_seconds", "Seconds spent reading and checking KV tier entries "
                                    "(loader thread).", tier_labels, registry=r),
            "expiries": Counter("ferry_kv_tier_expiries", "KV tier entries removed after their idle TTL.", tier_labels,
                                registry=r),
            "io_errors": Counter("ferry_kv_tier_io_errors", "KV tier store operations that failed with an I/O error "
                                 "(directory removed or unreadable, filesystem error); each is a miss.", tier_labels,
                                 registry=r),
        }
        self._tier_usage = Gauge("ferry_kv_tier_usage_bytes", "Bytes held by a KV tier's entries.", tier_labels,
                                 registry=r)
        self._tier_failures = Counter(
            "ferry_kv_tier_integrity_failures", "KV tier entries refused when loaded, by reason (truncated, format, "
            "signature, weights); each is deleted and the prompt recomputed.", [*tier_labels, "reason"], registry=r)
        self._kv_events = Counter(
            "ferry_kv_events", "KV cache events produced (blocks stored/removed, cleared); see GET /v1/kv-events.",
            labels, registry=r)
        self._kv_events_sent = Counter(
            "ferry_kv_events_sent", "KV cache events sent on GET /v1/kv-events streams (all subscribers).",
            labels, registry=r)
        self._kv_events_bytes = Counter(
            "ferry_kv_events_sent_bytes", "Bytes of NDJSON sent on GET /v1/kv-events streams (all subscribers).",
            labels, registry=r)
        # Pre-create the per-outcome children so rates start from 0 rather than appearing late.
        for outcome in REQUEST_OUTCOMES:
            self._requests.labels(**self.identity, outcome=outcome)
        for metric in (self._waiting, self._running, self._prompt_tokens, self._generation_tokens, self._kv_usage,
                       self._busy, self._ready, self._ttft, self._tpot, self._e2e, self._prompt_lengths,
                       self._computed_lengths, self._generation_lengths, self._prefix_queries,
                       self._prefix_hits, self._kv_events, self._kv_events_sent, self._kv_events_bytes):
            metric.labels(**self.identity)

    def request_finished(self, outcome: str) -> None:
        """Count one finished request. Raises ValueError for an outcome outside REQUEST_OUTCOMES."""
        if outcome not in REQUEST_OUTCOMES:
            raise ValueError(f"unknown request outcome {outcome!r}; allowed: {REQUEST_OUTCOMES}")
        self._requests.labels(**self.identity, outcome=outcome).inc()

    def kv_recompute(self, reason: str) -> None:
        """Count one local recompute after a failed KV hand-off. Raises ValueError for an unknown reason."""
        if reason not in KV_TRANSFER_REASONS or reason == "none":
            raise ValueError(f"unknown KV transfer failure reason {reason!r}; allowed: {KV_TRANSFER_REASONS[1:]}")
        self._kv_recompute.labels(**self.identity, reason=reason).inc()

    def tokens(self, *, num_prompt_tokens: int = 0, num_generation_tokens: int = 0) -> None:
        """Add prefilled prompt tokens and generated tokens."""
        if num_prompt_tokens:
            self._prompt_tokens.labels(**self.identity).inc(num_prompt_tokens)
        if num_generation_tokens:
            self._generation_tokens.labels(**self.identity).inc(num_generation_tokens)

    def observe_lengths(self, *, num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> None:
        """Record one finished choice's lengths in tokens: its prompt, the prompt minus the ``num_cached_tokens`` a
        prefix cache held (the computed tokens), and its output.

        Raises:
            ValueError: a negative count, or more cached tokens than the prompt has.
        """
        if min(num_prompt_tokens, num_cached_tokens, num_output_tokens) < 0 or num_cached_tokens > num_prompt_tokens:
            raise ValueError(f"need 0 <= cached ({num_cached_tokens}) <= prompt ({num_prompt_tokens}) tokens and "
                             f"output >= 0 ({num_output_tokens})")
        self._prompt_lengths.labels(**self.identity).observe(num_prompt_tokens)
        self._computed_lengths.labels(**self.identity).observe(num_prompt_tokens - num_cached_tokens)
        self._generation_lengths.labels(**self.identity).observe(num_output_tokens)

    def observe_latency(self, *, ttft_s: float | None, e2e_s: float, num_output_tokens: int) -> None:
        """Record one finished request's TTFT, TPOT and end-to-end latency (seconds)."""
        if ttft_s is not None:
            self._ttft.labels(**self.identity).observe(ttft_s)
            if num_output_tokens > 1:
                self._tpot.labels(**self.identity).observe((e2e_s - ttft_s) / (num_output_tokens - 1))
        self._e2e.labels(**self.identity).observe(e2e_s)

    def set_engine_state(self, *, num_waiting: int, num_running: int, kv_cache_usage: float | None,
                         busy_ratio: float) -> None:
        """Update the queue, KV usage and busy gauges (KV usage left unchanged when unknown)."""
        self._waiting.labels(**self.identity).set(num_waiting)
        self._running.labels(**self.identity).set(num_running)
        if kv_cache_usage is not None:
            self._kv_usage.labels(**self.identity).set(kv_cache_usage)
        self._busy.labels(**self.identity).set(busy_ratio)

    def prefix_cache(self, stats: Mapping, previous: Mapping) -> None:
        """Advance the prefix-cache series from engine counters (``PagedLLMEngine.prefix_cache_stats``).

        ``stats``/``previous``: ``query_tokens``, ``hit_tokens``, per group ``evictions`` (cumulative)
        and ``cached_blocks`` (now), and per KV tier (``tiers``, when configured) hits, bytes read and
        written, load seconds, expiries, integrity failures by reason (cumulative) and usage bytes (now);
        counters grow by the difference to ``previous`` (empty at start).
        """
        for counter, key in ((self._prefix_queries, "query_tokens"), (self._prefix_hits, "hit_tokens")):
            delta = stats[key] - previous.get(key, 0)
            if delta > 0:
                counter.labels(**self.identity).inc(delta)
        for group, evictions in stats["evictions"].items():
            delta = evictions - previous.get("evictions", {}).get(group, 0)
            child = self._prefix_evictions.labels(**self.identity, group=group)
            if delta > 0:
                child.inc(delta)
        for group, num_blocks in stats["cached_blocks"].items():
            self._prefix_blocks.labels(**self.identity, group=group).set(num_blocks)
        for tier, current in stats.get("tiers", {}).items():
            before = previous.get("tiers", {}).get(tier, {})
            for key, counter in self._tier_counters.items():
                delta = current[key] - before.get(key, 0)
                if delta > 0:
                    counter.labels(**self.identity, tier=tier).inc(delta)
            self._tier_usage.labels(**self.identity, tier=tier).set(current["usage_bytes"])
            for reason, count in current["integrity_failures"].items():
                delta = count - before.get("integrity_failures", {}).get(reason, 0)
                if delta > 0:
                    self._tier_failures.labels(**self.identity, tier=tier, reason=reason).inc(delta)

    def kv_events(self, num_produced: int, num_sent: int, num_bytes_sent: int) -> None:
        """Add KV events produced by the engine, and events and bytes sent to KV-event subscribers."""
        for counter, value in ((self._kv_events, num_produced), (self._kv_events_sent, num_sent),
                               (self._kv_events_bytes, num_bytes_sent)):
            if value > 0:
                counter.labels(**self.identity).inc(value)

    def set_ready(self, ready: bool) -> None:
        """Export readiness (1 ready, 0 loading or draining)."""
        self._ready.labels(**self.identity).set(1 if ready else 0)

    def set_gpu(self, *, utilization: float | None, memory_used_bytes: int | None) -> None:
        """Update GPU gauges; a no-op on a worker built with ``gpu=False``."""
        if self._gpu_util is not None and utilization is not None:
            self._gpu_util.labels(**self.identity).set(utilization)
        if self._gpu_mem is not None and memory_used_bytes is not None:
            self._gpu_mem.labels(**self.identity).set(memory_used_bytes)
