"""Direct scrape: read each replica's ``/metrics`` over HTTP and keep recent samples in memory.

This is the default for local clusters (no Prometheus needed). Each poll scrapes every replica
(httpx, concurrently, short timeout), parses the exposition text with prometheus-client's
parser and appends one sample per series to a ``SampleStore`` that forgets samples older than
its retention. Signals are then evaluated with the same specs and math as PromQL.

Replica state follows Prometheus' staleness idea: a replica whose last scrape failed is "down";
its gauges stop counting at once (like stale markers), while its counter samples already in
the window still count towards rates.
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
from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.signals import Matcher, Scope, SignalSet, evaluate_signals, labels_match
from apps.telemetry.sources.base import MetricSource

logger = logging.getLogger(__name__)

ReplicaKey = tuple[str, str, str]
SeriesKey = tuple[ReplicaKey, str, tuple[tuple[str, str], ...]]


@dataclass
class _ReplicaState:
    endpoint: ReplicaEndpoint
    last_seen_s: float
    up: bool
    last_ok_s: float | None = None


class SampleStore:
    """Recent samples per series per replica, trimmed to ``retention_s`` seconds.

    Raises ``ValueError`` for a non-positive retention or unparsable exposition text.
    """

    def __init__(self, retention_s: float):
        if retention_s <= 0:
            raise ValueError(f"retention must be positive, got {retention_s} s")
        self.retention_s = retention_s
        self._series: dict[SeriesKey, deque[tuple[float, float]]] = {}
        self._replicas: dict[ReplicaKey, _ReplicaState] = {}

    def ingest(self, endpoint: ReplicaEndpoint, text: str, at_s: float) -> int:
        """Parse exposition ``text`` scraped from ``endpoint`` at ``at_s``; returns samples stored."""
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as exc:
            raise ValueError(f"replica {endpoint.replica} returned unparsable metrics: {exc}") from exc
        stored = 0
        for family in families:
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = tuple(sorted(sample.labels.items()))
                series = self._series.setdefault((endpoint.key, sample.name, labels), deque())
                series.append((at_s, float(sample.value)))
                stored += 1
        state = self._replicas.get(endpoint.key)
        if state is None:
            state = self._replicas[endpoint.key] = _ReplicaState(endpoint, at_s, True)
        state.endpoint, state.last_seen_s, state.up, state.last_ok_s = endpoint, at_s, True, at_s
        return stored

    def mark_down(self, endpoint: ReplicaEndpoint, at_s: float) -> None:
        """Record a failed scrape: the replica's gauges stop counting until it answers again."""
        state = self._replicas.setdefault(endpoint.key, _ReplicaState(endpoint, at_s, False))
        state.endpoint, state.last_seen_s, state.up = endpoint, at_s, False

    def forget_missing(self, present: Sequence[ReplicaEndpoint]) -> None:
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

    def view(self, scope: Scope) -> ScopeView:
        """A ``SeriesView`` over the replicas of ``scope``."""
        replicas = {
            key: state
            for key, state in self._replicas.items()
            if state.endpoint.pool_id == scope.pool and (scope.track is None or state.endpoint.track == scope.track)
        }
        return ScopeView(self, replicas)


class ScopeView:
    """The ``SeriesView`` of one scope inside a ``SampleStore``."""

    def __init__(self, store: SampleStore, replicas: dict[ReplicaKey, _ReplicaState]):
        self._store = store
        self._replicas = replicas

    def series(self, metric: str, matchers: Sequence[Matcher]):
        out = []
        for (replica, name, labels), samples in self._store._series.items():
            if name == metric and replica in self._replicas and labels_match(dict(labels), matchers):
                out.append((dict(labels), list(samples)))
        return out

    def latest(self, metric: str, matchers: Sequence[Matcher]) -> list[float]:
        values = []
        for (replica, name, labels), samples in self._store._series.items():
            state = self._replicas.get(replica)
            if name != metric or state is None or not state.up or not labels_match(dict(labels), matchers):
                continue
            t, value = samples[-1]
            if t == state.last_ok_s:  # the series was in the replica's latest exposition
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


class DirectScrapeSource(MetricSource):
    """Scrapes replicas itself and evaluates signals from the samples it keeps.

    ``timeout_s`` bounds each scrape; ``retention_s`` must cover the longest window asked
    for. ``clock`` returns seconds (``time.time`` by default; tests pass a fake clock).
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
    ):
        self.store = SampleStore(retention_s)
        self._client = client or httpx.Client(timeout=timeout_s)
        self._owns_client = client is None
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ferry-scrape")

    def _scrape(self, endpoint: ReplicaEndpoint) -> tuple[ReplicaEndpoint, str | None, float]:
        try:
            response = self._client.get(endpoint.metrics_url)
            response.raise_for_status()
            return endpoint, response.text, self._clock()
        except httpx.HTTPError as exc:
            logger.info("scrape of %s failed: %s", endpoint.metrics_url, exc)
            return endpoint, None, self._clock()

    def refresh(self, endpoints: Sequence[ReplicaEndpoint], now_s: float) -> None:
        """Scrape every endpoint once; failures mark the replica down (logged, not raised)."""
        for endpoint, text, at_s in self._pool.map(self._scrape, endpoints):
            if text is None:
                self.store.mark_down(endpoint, at_s)
                continue
            try:
                self.store.ingest(endpoint, text, at_s)
            except ValueError as exc:
                logger.warning("%s", exc)
                self.store.mark_down(endpoint, at_s)
        self.store.forget_missing(endpoints)
        self.store.prune(now_s)

    def signals(self, scope: Scope, *, window_s: float, at_s: float) -> SignalSet:
        if window_s > self.store.retention_s:
            raise ValueError(f"window {window_s} s exceeds the scrape retention {self.store.retention_s} s")
        return evaluate_signals(self.store.view(scope), scope, at_s, window_s, self.name)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self._owns_client:
            self._client.close()
