"""Direct scrape: read each replica's ``/metrics`` over HTTP and keep recent samples in memory.

This is the default for local clusters (no Prometheus needed). Each poll scrapes every replica
(httpx, concurrently, short timeout), parses the exposition text with prometheus-client's
parser and appends one sample per series to a ``SampleStore`` that forgets samples older than
its retention. Signals are then evaluated with the same specs and math as PromQL.

Replica state follows Prometheus' staleness idea: a replica whose last scrape failed is "down";
its gauges stop counting at once (like stale markers), while its counter samples already in
the window still count towards rates.

A counter (or histogram/summary count, sum or bucket) series that first appears in a scrape of an
endpoint whose previous scrape succeeded without it is stored with a 0 sample at that previous
scrape: prometheus-client creates a labelled series at its first increment, so without the 0 its
first increments would never count (a router's two single decisions, ``local_prefill`` 1 and
``remote_prefill`` 1, each a new series, charted as 0/s). Prometheus 2.x without created-timestamp
ingestion misses these increments; series already present at an endpoint's first scrape, or after
a failed scrape, get no 0 (their history is unknown).

Routers (``RouterEndpoint``) are scraped the same way but belong to no pool: a pool's view
takes router series by their ``pool`` label (``Scope.matchers``), from the store itself and
from a shared router store (the poller scrapes the routers once per poll for every cluster).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from apps.telemetry import metric_names as m
from apps.telemetry.endpoints import ReplicaEndpoint, RouterEndpoint
from apps.telemetry.signals import (
    Matcher,
    Scope,
    SignalSet,
    evaluate_signals,
    kv_transfer_breakdown,
    labels_match,
)
from apps.telemetry.sources.base import MetricSource
from inference_worker.engine_kinds import FERRY, translate_name, translate_samples

logger = logging.getLogger(__name__)

ReplicaKey = tuple[str, str, str]
SeriesKey = tuple[ReplicaKey, str, tuple[tuple[str, str], ...]]
Endpoint = ReplicaEndpoint | RouterEndpoint


@dataclass
class _ReplicaState:
    endpoint: Endpoint
    last_seen_s: float
    up: bool
    last_ok_s: float | None = None
    series: frozenset[tuple[str, tuple[tuple[str, str], ...]]] = frozenset()  # (name, labels) in the last ok scrape

    @property
    def is_router(self) -> bool:
        return isinstance(self.endpoint, RouterEndpoint)


_MONOTONIC_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                       "summary": ("_count", "_sum")}


def _starts_at_zero(family_type: str, sample_name: str) -> bool:
    """Whether a sample of this family type counts up from 0 when its series is created (counter
    ``_total``; histogram ``_bucket``/``_count``/``_sum``; summary ``_count``/``_sum``)."""
    return sample_name.endswith(_MONOTONIC_SUFFIXES.get(family_type, ()))


def _samples(endpoint: Endpoint, families: list) -> list[tuple[str, dict[str, str], float, bool]]:
    """``(name, labels, value, monotonic)`` of every sample worth storing, in Ferry's names.

    A replica of another engine kind (``ReplicaEndpoint.engine``) has its series translated by
    :func:`inference_worker.engine_kinds.translate_samples` (what Ferry does not read is left out); ``monotonic``:
    the series counts up from 0 when created (:func:`_starts_at_zero`).
    """
    engine = getattr(endpoint, "engine", FERRY)
    if engine == FERRY:
        return [(sample.name, sample.labels, sample.value, _starts_at_zero(family.type, sample.name))
                for family in families for sample in family.samples if not sample.name.endswith("_created")]
    kinds = {sample.name: family.type for family in families for sample in family.samples}
    translated = translate_samples(engine, ((sample.name, sample.labels, sample.value)
                                            for family in families for sample in family.samples
                                            if not sample.name.endswith("_created")))
    monotonic_names = {target for source, family_type in kinds.items() if _starts_at_zero(family_type, source)
                       for target in [translate_name(engine, source)] if target is not None}
    return [(name, labels, value, name in monotonic_names) for name, labels, value in translated]


class SampleStore:
    """Recent samples per series per replica (or router), trimmed to ``retention_s`` seconds.

    Raises ``ValueError`` for a non-positive retention or unparsable exposition text.
    """

    def __init__(self, retention_s: float):
        if retention_s <= 0:
            raise ValueError(f"retention must be positive, got {retention_s} s")
        self.retention_s = retention_s
        self._series: dict[SeriesKey, deque[tuple[float, float]]] = {}
        self._replicas: dict[ReplicaKey, _ReplicaState] = {}

    def ingest(self, endpoint: Endpoint, text: str, at_s: float) -> int:
        """Parse exposition ``text`` scraped from ``endpoint`` at ``at_s``; returns samples stored."""
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as exc:
            raise ValueError(f"{endpoint.metrics_url} returned unparsable metrics: {exc}") from exc
        state = self._replicas.get(endpoint.key)
        # The previous scrape answered: a monotonic series missing from it was created since (at 0).
        previous_ok_s = (state.last_ok_s if state is not None and state.up and state.last_ok_s is not None
                         and state.last_ok_s < at_s else None)
        stored = 0
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for name, sample_labels, value, monotonic in _samples(endpoint, families):
            labels = tuple(sorted(sample_labels.items()))
            series = self._series.setdefault((endpoint.key, name, labels), deque())
            if previous_ok_s is not None and (name, labels) not in state.series and monotonic:
                series.append((previous_ok_s, 0.0))
            series.append((at_s, float(value)))
            seen.add((name, labels))
            stored += 1
        if state is None:
            state = self._replicas[endpoint.key] = _ReplicaState(endpoint, at_s, True)
        state.endpoint, state.last_seen_s, state.up, state.last_ok_s = endpoint, at_s, True, at_s
        state.series = frozenset(seen)
        return stored

    def mark_down(self, endpoint: Endpoint, at_s: float) -> None:
        """Record a failed scrape: the replica's gauges stop counting until it answers again."""
        state = self._replicas.setdefault(endpoint.key, _ReplicaState(endpoint, at_s, False))
        state.endpoint, state.last_seen_s, state.up = endpoint, at_s, False

    def forget_missing(self, present: Sequence[Endpoint]) -> None:
        """Replicas no longer listed are down (their samples age out with the retention)."""
        keys = {ep.key for ep in present}
        for key, state in self._replicas.items():
            if key not in keys:
                state.up = False

    def prune(self, now_s: float) -> None:
        """Drop samples older than the retention, then empty series and long-gone replicas."""
        horizon = now_s - self.retention_s
        for key in list(self._series):
            series = self._series[key]
            while series and series[0][0] < horizon:
                series.popleft()
            if not series:
                del self._series[key]
        for key in [k for k, s in self._replicas.items() if s.last_seen_s < horizon]:
            del self._replicas[key]

    def view(self, scope: Scope, routers: SampleStore | None = None) -> ScopeView:
        """A ``SeriesView`` over the replicas of ``scope`` (by endpoint pool id and track) and the
        router series labelled with the scope's pool (and track), here and in ``routers``."""
        replicas = {
            key: state
            for key, state in self._replicas.items()
            if not state.is_router and state.endpoint.pool_id == scope.pool
            and (scope.track is None or state.endpoint.track == scope.track)
        }
        stores = [self] if routers is None or routers is self else [self, routers]
        return ScopeView(self, replicas, router_stores=stores, router_matchers=scope.matchers())

    def routers(self) -> dict[ReplicaKey, _ReplicaState]:
        """The routers this store has samples of."""
        return {key: state for key, state in self._replicas.items() if state.is_router}

    def router_series(self, metric: str) -> list[tuple[ReplicaKey, dict[str, str], list[tuple[float, float]]]]:
        """``(router key, labels, samples)`` of every router series named ``metric`` (samples oldest first; a
        series created since the router's previous good scrape starts with the 0 sample :meth:`ingest` adds)."""
        routers = self.routers()
        return [(key, dict(labels), list(samples)) for (key, name, labels), samples in self._series.items()
                if name == metric and key in routers and samples]


class ScopeView:
    """The ``SeriesView`` of one scope inside a ``SampleStore``.

    ``replicas``: the scope's replicas in ``store``. ``router_stores``: stores whose router
    series count when their labels satisfy ``router_matchers`` (the scope's pool/track labels).
    """

    def __init__(self, store: SampleStore, replicas: dict[ReplicaKey, _ReplicaState], *,
                 router_stores: Sequence[SampleStore] = (), router_matchers: Sequence[Matcher] = ()):
        self._store = store
        self._replicas = replicas
        self._routers = [(s, routers) for s in router_stores if (routers := s.routers())]
        self._router_matchers = tuple(router_matchers)

    def _matching(self, metric: str, matchers: Sequence[Matcher]):
        """``(state, labels, samples)`` of every matching series of the scope's replicas and routers."""
        for (replica, name, labels), samples in self._store._series.items():
            state = self._replicas.get(replica)
            if name == metric and state is not None and labels_match(dict(labels), matchers):
                yield state, dict(labels), samples
        router_matchers = (*self._router_matchers, *matchers)
        for store, routers in self._routers:
            for (router, name, labels), samples in store._series.items():
                state = routers.get(router)
                if name == metric and state is not None and labels_match(dict(labels), router_matchers):
                    yield state, dict(labels), samples

    def series(self, metric: str, matchers: Sequence[Matcher]):
        return [(labels, list(samples)) for _, labels, samples in self._matching(metric, matchers)]

    def latest(self, metric: str, matchers: Sequence[Matcher]) -> list[float]:
        values = []
        for state, _, samples in self._matching(metric, matchers):
            t, value = samples[-1]
            if state.up and t == state.last_ok_s:  # the series was in the latest exposition
                values.append(value)
        return values

    def ready_replicas(self) -> int | None:
        if not self._replicas:
            return None
        ready = 0
        for key, state in self._replicas.items():
            if not state.up:
                continue
            flag = None  # a worker without the readiness gauge counts as ready while it answers
            for (replica, name, _), samples in self._store._series.items():
                if replica == key and name == m.READY and samples[-1][0] == state.last_ok_s:
                    flag = samples[-1][1]
            ready += 1 if flag is None or flag == 1.0 else 0
        return ready


@dataclass
class _Outage:
    since_s: float
    count: int
    first_error: str
    last_error: str


class ScrapeFailures:
    """Logs a scrape target's outage, not every failed poll: one INFO line when a target starts failing
    (its error), one when it answers again and one when it is no longer scraped (each with the number of
    failed scrapes and the seconds since the first). Workers starting and stopping make targets refuse
    connections for a while; a poll every half second would otherwise log each refusal.

    ``outages``: metrics URL -> the current outage (read by tests and the poller)."""

    def __init__(self) -> None:
        self.outages: dict[str, _Outage] = {}

    def failed(self, url: str, error: str, at_s: float) -> None:
        outage = self.outages.get(url)
        if outage is None:
            self.outages[url] = _Outage(at_s, 1, error, error)
            logger.info("scrape of %s failing: %s (logged again when it recovers)", url, error)
        else:
            outage.count += 1
            outage.last_error = error

    def succeeded(self, url: str, at_s: float) -> None:
        outage = self.outages.pop(url, None)
        if outage is not None:
            logger.info("scrape of %s recovered after %d failed scrapes over %.1f s (last error: %s)",
                        url, outage.count, at_s - outage.since_s, outage.last_error)

    def forget_missing(self, urls: set[str]) -> None:
        for url in [u for u in self.outages if u not in urls]:
            outage = self.outages.pop(url)
            logger.info("scrape of %s no longer asked for after %d failed scrapes (last error: %s)",
                        url, outage.count, outage.last_error)


class DirectScrapeSource(MetricSource):
    """Scrapes replicas (and routers) itself and evaluates signals from the samples it keeps.

    ``timeout_s`` bounds each scrape; ``retention_s`` must cover the longest window asked
    for. ``clock`` returns seconds (``time.time`` by default; tests pass a fake clock).
    ``routers``: a store of router samples that another source fills (shared by the poller's
    scrape sources, so each router is scraped once per poll); pool signals read router series
    from it and from this source's own store.
    """

    name = "scrape"

    def __init__(
        self,
        *,
        retention_s: float = 120.0,
        timeout_s: float = 1.0,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
        max_workers: int = 8,
        routers: SampleStore | None = None,
    ):
        self.store = SampleStore(retention_s)
        self.routers = routers
        self._client = client or httpx.Client(timeout=timeout_s)
        self._owns_client = client is None
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ferry-scrape")
        self.failures = ScrapeFailures()

    def _scrape(self, endpoint: Endpoint) -> tuple[Endpoint, str, float, bool]:
        """``(endpoint, exposition text or the error, when, ok)``."""
        try:
            response = self._client.get(endpoint.metrics_url)
            response.raise_for_status()
            return endpoint, response.text, self._clock(), True
        except httpx.HTTPError as exc:
            return endpoint, f"{type(exc).__name__}: {exc}", self._clock(), False

    def refresh(self, endpoints: Sequence[Endpoint], now_s: float) -> None:
        """Scrape every endpoint once; failures mark the replica down (logged once per outage by
        :class:`ScrapeFailures`, not raised)."""
        for endpoint, text, at_s, ok in self._pool.map(self._scrape, endpoints):
            if not ok:
                self.failures.failed(endpoint.metrics_url, text, at_s)
                self.store.mark_down(endpoint, at_s)
                continue
            try:
                self.store.ingest(endpoint, text, at_s)
            except ValueError as exc:
                self.failures.failed(endpoint.metrics_url, str(exc), at_s)
                self.store.mark_down(endpoint, at_s)
                continue
            self.failures.succeeded(endpoint.metrics_url, at_s)
        self.failures.forget_missing({e.metrics_url for e in endpoints})
        self.store.forget_missing(endpoints)
        self.store.prune(now_s)

    def signals(self, scope: Scope, *, window_s: float, at_s: float) -> SignalSet:
        if window_s > self.store.retention_s:
            raise ValueError(f"window {window_s} s exceeds the scrape retention {self.store.retention_s} s")
        return evaluate_signals(self.store.view(scope, self.routers), scope, at_s, window_s, self.name)

    def kv_transfers(self, scope: Scope, *, window_s: float, at_s: float) -> dict:
        return kv_transfer_breakdown(self.store.view(scope), at_s - window_s, at_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self._owns_client:
            self._client.close()
