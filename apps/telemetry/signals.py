"""Signal definitions: one spec per signal, evaluated by PromQL or over directly scraped samples.

Each signal is declared once (``SIGNAL_SPECS``). A spec can render itself as PromQL for the
Prometheus source and can evaluate itself over a ``SeriesView`` (the samples the direct-scrape
source keeps), using the Prometheus-compatible math in ``series_math``. Both paths aggregate
the same way — ``sum``/``avg``/``max`` across the replicas of a pool (or one track) — so the
autoscaler, rollout gates and dashboard read one meaning per name.

Units are in the names: ``_per_s`` rates, ``_s`` seconds, ratios in 0..1, plain counts.

``None`` is "no data" for that signal, not "unreadable source": the quantiles (``ttft_p99_s``...)
and failure ratios are ``None`` in a window without requests, while ``request_rate_per_s`` is a
real ``0.0`` as long as the replicas' request counters answered (workers export every outcome
series from start, so a worker that never served still answers 0). A source that
could not be read gives ``None`` for the rate too. ``request_rate_per_s == 0`` together with an
empty quantile therefore means idle — the autoscaler's rule (``apps.operations.autoscale_math``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from apps.telemetry import metric_names as m
from apps.telemetry.series_math import (
    Sample,
    counter_rate,
    finite_or_none,
    histogram_quantile,
    safe_ratio,
)
from inference_worker.engine_kinds import FERRY, UNSUPPORTED_SIGNALS

Matcher = tuple[str, str, str]  # (label, op, value) with op one of "=", "!=", "=~", "!~"


def labels_match(labels: Mapping[str, str], matchers: Sequence[Matcher]) -> bool:
    """Whether ``labels`` satisfy every PromQL-style matcher (a missing label reads as "")."""
    for name, op, value in matchers:
        actual = labels.get(name, "")
        if op == "=":
            ok = actual == value
        elif op == "!=":
            ok = actual != value
        elif op in ("=~", "!~"):
            ok = re.fullmatch(value, actual) is not None
            ok = ok if op == "=~" else not ok
        else:
            raise ValueError(f"unknown label matcher operator {op!r}; use =, !=, =~ or !~")
        if not ok:
            return False
    return True


def promql_selector(metric: str, matchers: Sequence[Matcher]) -> str:
    """``metric{label="value",...}`` with values escaped for PromQL string literals."""
    if not matchers:
        return metric
    parts = []
    for name, op, value in matchers:
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        parts.append(f'{name}{op}"{escaped}"')
    return metric + "{" + ",".join(parts) + "}"


class SeriesView(Protocol):
    """Samples of one scope (a pool or one track), as the direct-scrape source holds them.

    A scope's series are those of its replicas (by the endpoint they were scraped from) and those
    of the routers whose labels name the scope's pool (and track): ``Scope.matchers``.
    """

    def series(self, metric: str, matchers: Sequence[Matcher]) -> list[tuple[dict[str, str], list[Sample]]]:
        """Every matching series with its labels and time-ordered samples."""
        ...

    def latest(self, metric: str, matchers: Sequence[Matcher]) -> list[float]:
        """The current value of every matching series of replicas that are up now."""
        ...

    def ready_replicas(self) -> int | None:
        """Replicas that answered their last scrape and report ready; ``None`` if none are known."""
        ...


def _agg(agg: str, by: Sequence[str], extra: Sequence[str] = ()) -> str:
    """``sum(`` or ``sum by (pool) (`` — the opening of a PromQL aggregation."""
    labels = [*by, *extra]
    return f"{agg} by ({', '.join(labels)}) (" if labels else f"{agg}("


def _sum_rates(view: SeriesView, metric: str, matchers: Sequence[Matcher], start: float, end: float):
    rates = [counter_rate(samples, start, end) for _, samples in view.series(metric, matchers)]
    rates = [r for r in rates if r is not None]
    return finite_or_none(math.fsum(rates)) if rates else None


@dataclass(frozen=True)
class CounterRate:
    """``sum(rate(metric{matchers}[window]))``: a per-second rate summed over replicas."""

    metric: str
    matchers: tuple[Matcher, ...] = ()

    def promql(self, scope: Sequence[Matcher], window_s: float, by: Sequence[str] = ()) -> str:
        selector = promql_selector(self.metric, (*scope, *self.matchers))
        return f"{_agg('sum', by)}rate({selector}[{_dur(window_s)}]))"

    def evaluate(self, view: SeriesView, start_s: float, end_s: float) -> float | None:
        return _sum_rates(view, self.metric, self.matchers, start_s, end_s)


@dataclass(frozen=True)
class RateRatio:
    """``(sum(rate(num)) or vector(0)) / sum(rate(den))``: a failure fraction in 0..1.

    The numerator reads as 0 when its series do not exist yet (no failure was ever counted),
    so a healthy pool shows 0 while traffic flows; no traffic (denominator 0 or absent) is
    "no data".
    """

    numerator: CounterRate
    denominator: CounterRate

    def promql(self, scope: Sequence[Matcher], window_s: float, by: Sequence[str] = ()) -> str:
        num = self.numerator.promql(scope, window_s, by)
        den = self.denominator.promql(scope, window_s, by)
        # Grouped (per-pool) queries drop the fallback: vector(0) has no labels to match on, and
        # a pool without failure series simply yields no result (nothing to alert on).
        return f"{num} / {den}" if by else f"({num} or vector(0)) / {den}"

    def evaluate(self, view: SeriesView, start_s: float, end_s: float) -> float | None:
        den = self.denominator.evaluate(view, start_s, end_s)
        num = self.numerator.evaluate(view, start_s, end_s)
        return safe_ratio(0.0 if num is None else num, den)


@dataclass(frozen=True)
class HistogramQuantile:
    """``histogram_quantile(q, sum by (le) (rate(base_bucket[window])))`` in the histogram's units.

    ``None`` when no observation fell in the window: idle or unreadable; tell them apart with
    ``request_rate_per_s`` from the same source (module docstring).
    """

    q: float
    base: str

    def promql(self, scope: Sequence[Matcher], window_s: float, by: Sequence[str] = ()) -> str:
        selector = promql_selector(f"{self.base}_bucket", scope)
        return f"histogram_quantile({self.q}, {_agg('sum', by, ('le',))}rate({selector}[{_dur(window_s)}])))"

    def evaluate(self, view: SeriesView, start_s: float, end_s: float) -> float | None:
        by_le: dict[float, float] = {}
        for labels, samples in view.series(f"{self.base}_bucket", ()):
            rate = counter_rate(samples, start_s, end_s)
            if rate is None or "le" not in labels:
                continue
            bound = float(labels["le"])
            by_le[bound] = by_le.get(bound, 0.0) + rate
        return histogram_quantile(self.q, by_le.items()) if by_le else None


@dataclass(frozen=True)
class HistogramMean:
    """``sum(rate(base_sum[window])) / sum(rate(base_count[window]))``: the mean observation in the window, in the
    histogram's units; ``None`` when nothing was observed (idle or unreadable, as :class:`HistogramQuantile`)."""

    base: str

    def promql(self, scope: Sequence[Matcher], window_s: float, by: Sequence[str] = ()) -> str:
        total = CounterRate(f"{self.base}_sum").promql(scope, window_s, by)
        count = CounterRate(f"{self.base}_count").promql(scope, window_s, by)
        return f"{total} / {count}"

    def evaluate(self, view: SeriesView, start_s: float, end_s: float) -> float | None:
        total = _sum_rates(view, f"{self.base}_sum", (), start_s, end_s)
        count = _sum_rates(view, f"{self.base}_count", (), start_s, end_s)
        return safe_ratio(total, count)


@dataclass(frozen=True)
class Gauge:
    """``<agg>(metric{matchers})``: the latest value of a gauge aggregated over up replicas."""

    metric: str
    agg: str = "sum"
    matchers: tuple[Matcher, ...] = ()
    scale: float = 1.0

    def __post_init__(self):
        if self.agg not in ("sum", "avg", "max"):
            raise ValueError(f"gauge aggregation must be sum, avg or max, got {self.agg!r}")

    def promql(self, scope: Sequence[Matcher], window_s: float, by: Sequence[str] = ()) -> str:
        text = f"{_agg(self.agg, by)}{promql_selector(self.metric, (*scope, *self.matchers))})"
        return text if self.scale == 1.0 else f"{text} * {self.scale}"

    def evaluate(self, view: SeriesView, start_s: float, end_s: float) -> float | None:
        values = view.latest(self.metric, self.matchers)
        if not values:
            return None
        if self.agg == "sum":
            value = math.fsum(values)
        elif self.agg == "avg":
            value = math.fsum(values) / len(values)
        else:
            value = max(values)
        return finite_or_none(value * self.scale)


@dataclass(frozen=True)
class ReadyReplicas:
    """Replicas serving now. PromQL: ``sum`` of the workers' ``ferry_worker_ready`` gauge (1 = ready)."""

    def promql(self, scope: Sequence[Matcher], window_s: float, by: Sequence[str] = ()) -> str:
        return f"{_agg('sum', by)}{promql_selector(m.READY, scope)})"

    def evaluate(self, view: SeriesView, start_s: float, end_s: float) -> float | None:
        ready = view.ready_replicas()
        return None if ready is None else float(ready)


def _dur(window_s: float) -> str:
    """A PromQL duration literal in whole milliseconds (``30s``, ``1500ms``)."""
    ms = round(window_s * 1000)
    if ms <= 0:
        raise ValueError(f"window must be positive, got {window_s} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _any_of(values: Sequence[str]) -> str:
    """An anchored-alternation regex for ``=~`` (PromQL anchors it; ``labels_match`` fullmatches it)."""
    return "|".join(re.escape(v) for v in values)


def _router_decisions(decisions: Sequence[str]) -> CounterRate:
    """Requests/s the router placed with one of ``decisions``, summed over routers and any other label."""
    return CounterRate(m.ROUTER_DECISIONS, ((m.ROUTER_DECISION_LABEL, "=~", _any_of(decisions)),))


_ERRORS = _any_of(m.REQUEST_ERROR_OUTCOMES)

SIGNAL_SPECS: dict[str, object] = {
    "request_rate_per_s": CounterRate(m.REQUESTS),
    "error_rate": RateRatio(
        CounterRate(m.REQUESTS, ((m.REQUEST_OUTCOME_LABEL, "=~", _ERRORS),)), CounterRate(m.REQUESTS)
    ),
    "num_requests_waiting": Gauge(m.NUM_REQUESTS_WAITING, "sum"),
    "num_requests_running": Gauge(m.NUM_REQUESTS_RUNNING, "sum"),
    "kv_cache_usage": Gauge(m.KV_CACHE_USAGE, "avg"),
    "kv_cache_usage_max": Gauge(m.KV_CACHE_USAGE, "max"),
    "ttft_p50_s": HistogramQuantile(0.5, m.TTFT),
    "ttft_p95_s": HistogramQuantile(0.95, m.TTFT),
    "ttft_p99_s": HistogramQuantile(0.99, m.TTFT),
    "tpot_p50_s": HistogramQuantile(0.5, m.TPOT),
    "tpot_p95_s": HistogramQuantile(0.95, m.TPOT),
    "tpot_p99_s": HistogramQuantile(0.99, m.TPOT),
    "prompt_tokens_per_s": CounterRate(m.PROMPT_TOKENS),
    # Request lengths (tokens) of the requests this pool answered, wherever their prompt was prefilled: the
    # capacity planner's "last hour's traffic" (apps.planning.selectors.telemetry_workload).
    # Sequences (a request's choices: n > 1 prefills and decodes each) answered per second, profiling sweeps left
    # out: the planner's arrival rate, with the lengths below (per sequence).
    "request_sequences_per_s": CounterRate(f"{m.REQUEST_PROMPT_TOKENS}_count"),
    "request_prompt_tokens_mean": HistogramMean(m.REQUEST_PROMPT_TOKENS),
    "request_computed_prompt_tokens_mean": HistogramMean(m.REQUEST_COMPUTED_PROMPT_TOKENS),
    "request_computed_prompt_tokens_p50": HistogramQuantile(0.5, m.REQUEST_COMPUTED_PROMPT_TOKENS),
    "request_computed_prompt_tokens_p90": HistogramQuantile(0.9, m.REQUEST_COMPUTED_PROMPT_TOKENS),
    "request_computed_prompt_tokens_p99": HistogramQuantile(0.99, m.REQUEST_COMPUTED_PROMPT_TOKENS),
    "request_generation_tokens_mean": HistogramMean(m.REQUEST_GENERATION_TOKENS),
    "generation_tokens_per_s": CounterRate(m.GENERATION_TOKENS),
    "kv_transfer_failure_rate": RateRatio(
        CounterRate(m.KV_TRANSFERS, ((m.KV_TRANSFER_OUTCOME_LABEL, "=", m.KV_TRANSFER_FAILURE_OUTCOME),)),
        CounterRate(m.KV_TRANSFERS),
    ),
    "kv_transfer_bytes_per_s": CounterRate(m.KV_TRANSFER_WIRE_BYTES),
    "engine_busy_ratio": Gauge(m.ENGINE_BUSY, "avg"),
    "gpu_utilization": Gauge(m.GPU_UTILIZATION, "avg"),
    "ready_replicas": ReadyReplicas(),
    # Router decisions for requests whose decode pool is this pool (the router's ``pool`` label).
    # Local includes the fallback; remote: the prompt went to a prefill pool and its KV came back.
    "router_local_prefill_per_s": _router_decisions(m.ROUTER_LOCAL_PREFILL_DECISIONS),
    "router_remote_prefill_per_s": _router_decisions(m.ROUTER_REMOTE_PREFILL_DECISIONS),
    "router_local_prefill_fallback_per_s": _router_decisions(m.ROUTER_LOCAL_PREFILL_FALLBACK_DECISIONS),
    # The routers' circuit breaker on this pool's replicas (summed over routers): ejections per second, and
    # replicas ejected now (a rollout gate: ``ejected_replicas``).
    "router_ejections_per_s": CounterRate(m.ROUTER_EJECTIONS),
    "router_ejected_replicas": Gauge(m.ROUTER_REPLICA_EJECTED, "sum"),
    # Prefix cache hit rate in tokens: prompt tokens found cached / prompt tokens looked up (0..1).
    "prefix_cache_hit_rate": RateRatio(CounterRate(m.PREFIX_CACHE_HITS), CounterRate(m.PREFIX_CACHE_QUERIES)),
    # Tier usage: KV blocks cached (reusable) on the device tier, summed over replicas; counted in the
    # full-attention group (a hybrid model's sliding group holds the same blocks until they leave the window).
    "prefix_cache_device_blocks": Gauge(m.PREFIX_CACHE_BLOCKS, "sum",
                                        ((m.PREFIX_CACHE_GROUP_LABEL, "=", m.PREFIX_CACHE_FULL_GROUP),)),
    # Router index accuracy: cached tokens predicted / reported for this decode pool (1.0: exact; below 1 the
    # index missed hits, above 1 it expected blocks the worker no longer had).
    "router_index_accuracy": RateRatio(CounterRate(m.ROUTER_PREDICTED_CACHED_TOKENS),
                                       CounterRate(m.ROUTER_REPORTED_CACHED_TOKENS)),
}
"""Signal name -> spec. Names carry units; every value may be ``None`` (no data; with a request rate of
exactly 0 from the same source an empty latency quantile means idle, see the module docstring)."""

SIGNAL_NAMES: tuple[str, ...] = tuple(SIGNAL_SPECS)


@dataclass(frozen=True)
class Scope:
    """What a signal set describes: a pool (``track`` None: all tracks) or one track of it.

    ``pool`` identifies the pool to the source: the Prometheus source selects series by the
    ``pool`` label (the pool's name); the direct-scrape source selects worker series by the
    scraped endpoint's pool id. ``label`` is the pool's ``pool`` label value when ``pool`` is
    not it (direct scrape: ``pool`` is the id): series that carry the pool only as a label,
    like the router's, are selected by it. ``None``: ``pool`` is the label value.
    """

    pool: str
    track: str | None = None
    label: str | None = None
    engine: str = FERRY
    """The pool's engine kind: signals its metrics cannot give (:data:`~inference_worker.engine_kinds.
    UNSUPPORTED_SIGNALS`) are no data, never a value read from absent series."""

    @property
    def pool_label(self) -> str:
        """The value of the ``pool`` label of this scope's series."""
        return self.pool if self.label is None else self.label

    def matchers(self) -> tuple[Matcher, ...]:
        """``pool`` (and ``track``) label matchers selecting this scope's series by their labels."""
        base: tuple[Matcher, ...] = ((m.LABEL_POOL, "=", self.pool_label),)
        return base if self.track is None else (*base, (m.LABEL_TRACK, "=", self.track))

    @property
    def key(self) -> str:
        return self.pool if self.track is None else f"{self.pool}.{self.track}"


@dataclass
class SignalSet:
    """The signals of one scope at one instant over one window; ``values[name]`` None = no data."""

    scope: Scope
    at_s: float
    window_s: float
    source: str
    values: dict[str, float | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in UNSUPPORTED_SIGNALS.get(self.scope.engine, ()):
            if name in self.values:
                self.values[name] = None

    def get(self, name: str) -> float | None:
        if name not in SIGNAL_SPECS:
            raise KeyError(f"unknown signal {name!r}; known: {', '.join(SIGNAL_NAMES)}")
        return self.values.get(name)

    def as_dict(self) -> dict:
        return {
            "pool": self.scope.pool,
            "track": self.scope.track,
            "at": self.at_s,
            "window_s": self.window_s,
            "source": self.source,
            "values": dict(self.values),
        }


def evaluate_signals(view: SeriesView, scope: Scope, at_s: float, window_s: float, source: str) -> SignalSet:
    """Evaluate every spec over ``view`` for the range ``(at_s - window_s, at_s]``."""
    start = at_s - window_s
    values = {name: spec.evaluate(view, start, at_s) for name, spec in SIGNAL_SPECS.items()}
    return SignalSet(scope=scope, at_s=at_s, window_s=window_s, source=source, values=values)


KV_TRANSFER_KEYS = (m.KV_TRANSFER_DIRECTION_LABEL, m.KV_TRANSFER_OUTCOME_LABEL, m.KV_TRANSFER_REASON_LABEL)
"""The labels a KV-transfer breakdown groups by (``ferry_kv_transfer_total``)."""


def kv_transfer_breakdown_promql(scope: Sequence[Matcher], window_s: float) -> tuple[str, str]:
    """PromQL of :func:`kv_transfer_breakdown`: transfers/s by direction, outcome and reason, and wire bytes/s
    by direction, for the scope's series over ``window_s``."""
    transfers = promql_selector(m.KV_TRANSFERS, scope)
    wire = promql_selector(m.KV_TRANSFER_WIRE_BYTES, scope)
    return (f"sum by ({', '.join(KV_TRANSFER_KEYS)}) (rate({transfers}[{_dur(window_s)}]))",
            f"sum by ({m.KV_TRANSFER_DIRECTION_LABEL}) (rate({wire}[{_dur(window_s)}]))")


def kv_transfer_breakdown_from_rows(transfer_rows: Sequence[tuple[Mapping[str, str], float | None]],
                                    wire_rows: Sequence[tuple[Mapping[str, str], float | None]]) -> dict:
    """Sum per-series rates into the breakdown document (see :func:`kv_transfer_breakdown`); ``None`` rates
    (too few samples) are skipped."""
    transfers: dict[tuple[str, str, str], float] = {}
    for labels, rate in transfer_rows:
        if rate is not None:
            key = tuple(labels.get(k, "") for k in KV_TRANSFER_KEYS)
            transfers[key] = transfers.get(key, 0.0) + rate
    wire: dict[str, float] = {}
    for labels, rate in wire_rows:
        if rate is not None:
            direction = labels.get(m.KV_TRANSFER_DIRECTION_LABEL, "")
            wire[direction] = wire.get(direction, 0.0) + rate
    return {"transfers": [{"direction": d, "outcome": o, "reason": r, "per_s": v}
                          for (d, o, r), v in sorted(transfers.items())],
            "wire_bytes_per_s": dict(sorted(wire.items()))}


def kv_transfer_breakdown(view: SeriesView, start_s: float, end_s: float) -> dict:
    """KV transfers of a scope over ``(start_s, end_s]``, for the link page.

    Returns ``{"transfers": [{"direction", "outcome", "reason", "per_s"}, ...] (sorted by the three labels),
    "wire_bytes_per_s": {direction: bytes/s}}``: per-second rates (Prometheus ``rate()`` math) summed over the
    scope's replicas. Empty lists/dicts when the workers exported no transfer series yet (none happened).
    """
    return kv_transfer_breakdown_from_rows(
        [(labels, counter_rate(samples, start_s, end_s)) for labels, samples in view.series(m.KV_TRANSFERS, ())],
        [(labels, counter_rate(samples, start_s, end_s))
         for labels, samples in view.series(m.KV_TRANSFER_WIRE_BYTES, ())])
