"""The telemetry poller: every 1-2 s, signals for every pool and track, history, stream, alerts.

Runs as its own process (``manage.py telemetry``), not inside the Celery worker that runs long
actions. Each poll:

1. lists pools (``selectors.poll_targets``), replica endpoints (``endpoints.replica_endpoints``)
   and routers (``endpoints.router_endpoints``);
2. refreshes each metric source (direct scrape: scrape the replicas of its clusters' pools, and
   once for all of them the routers, whose decisions count for the pool they name);
3. computes pool-level and per-track ``SignalSet``s over ``window_s``, the pool's KV transfers by direction,
   outcome and reason (``kv_transfers``, the link page's breakdown), and each replica's ejections by the
   routers' circuit breaker (``ejections`` in the record, :func:`replica_ejections`; reconcile reads them);
4. broadcasts them (``telemetry.signals`` to the pool group, ``telemetry.fleet`` to the fleet
   group; values at :data:`SIGNAL_DIGITS` significant digits) with Redis sequence numbers, and appends the same pool records to the Redis history (the fleet
   record replaces the previous one: only the newest is read);
5. evaluates the effective alert rules on the pool-level signals and records transitions;
6. adds the routers' per-key request counts to the client API keys' use counts and last use
   (:mod:`apps.telemetry.key_uses`: one UPDATE per used key per poll);
7. computes each cluster link's KV load (Gbit/s and utilisation, :mod:`apps.telemetry.link_load`) from the
   pools' received KV bytes/s and stores it for the routers' bandwidth-aware PD decision
   (``GET /api/v1/link-load/``, :func:`apps.fleet.routing_table_cache.link_load_store`);
8. every ``slow_every`` polls, collects the slowest recent requests' phases from the replicas and routers
   (``/debug/slow-requests``, :mod:`.slow_requests`) and stores one snapshot per pool for the pool page.

The registered routers are scraped at every poll (for the key use counts), also when every cluster reads
Prometheus.

State that must survive a restart lives in Redis (history, sequence numbers) and Postgres
(firing alerts, restored into the evaluator at start). The direct-scrape samples are rebuilt
within one window after a restart.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

import httpx
import redis
from django.db import DatabaseError

from apps.accounts.services import client_key_uses_record
from apps.core.process_loop import loop_iteration_started
from apps.fleet.routing_table_cache import link_load_store
from apps.telemetry import metric_names as m
from apps.telemetry.alerts import AlertEvaluator, RuleSpec
from apps.telemetry.broadcast import FLEET_GROUP, pool_group, telemetry_broadcast
from apps.telemetry.endpoints import ReplicaEndpoint, RouterEndpoint, replica_endpoints, router_endpoints
from apps.telemetry.history import SignalHistory
from apps.telemetry.key_uses import KeyUseCounter
from apps.telemetry.link_load import link_load_document
from apps.telemetry.models import Alert
from apps.telemetry.selectors import SourceChoice, alert_rules_effective, history_scope, poll_targets
from apps.telemetry.services import alert_transitions_apply
from apps.telemetry.signals import Scope
from apps.telemetry.slow_requests import collect_slow_requests, slow_requests_store
from apps.telemetry.sources.base import MetricSource, MetricSourceError
from apps.telemetry.sources.prometheus import PrometheusSource
from apps.telemetry.sources.scrape import DirectScrapeSource, SampleStore

logger = logging.getLogger(__name__)


def scrape_retention_s(window_s: float) -> float:
    """How long direct scraping keeps samples for a poller with window ``window_s`` (seconds)."""
    return max(2 * window_s, window_s + 10.0)


def default_source_factory(choice: SourceChoice, *, window_s: float, routers: SampleStore | None = None) -> MetricSource:
    """Build the source for a cluster's ``SourceChoice``; ``routers``: the shared router samples
    (direct scrape only; Prometheus scrapes the routers itself)."""
    if choice.kind == "prometheus":
        dcgm = None
        if choice.dcgm:
            # Pods are named "<pool name>-<track>-<hash>" (apps.orchestrators: Deployment "<pool>-<track>");
            # DCGM's exporter labels each GPU series with the pod that holds it.
            def dcgm(scope: Scope, namespace=choice.namespace):
                pod = f"{re.escape(scope.pool)}-{scope.track or '[a-z]+'}-.*"
                return [("namespace", "=", namespace), ("pod", "=~", pod)] if namespace else [("pod", "=~", pod)]
        return PrometheusSource(choice.prometheus_url, dcgm_matchers=dcgm)
    return DirectScrapeSource(retention_s=scrape_retention_s(window_s), routers=routers)


SIGNAL_DIGITS = 6
"""Significant digits of the non-integral signal values a poll records (stream and history): a latency, rate or
ratio measured over a window is not known to more than about 4 digits, and the 17 digits of a float's repr are
what the history's compression cannot squeeze (the 2-pool demo's records compressed to about 90 and 150 bytes
each at full precision, 65 and 93 at 6 digits, 2026-12-02). Integral values (counts, totals, replica counts)
and the record's ``at`` are kept exact."""


SIGNAL_PARTS = ("signals", "tracks", "kv_transfers")
"""The parts of a pool record holding measured values, the ones :func:`significant` rounds."""


def significant(value: object, digits: int = SIGNAL_DIGITS) -> object:
    """``value`` with every finite non-integral float, in nested dicts and lists too, rounded to ``digits``
    significant digits (``0.5170436412210931`` -> ``0.517044``); other values unchanged."""
    if isinstance(value, float):
        if not math.isfinite(value) or value.is_integer():
            return value
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: significant(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [significant(v, digits) for v in value]
    return value


def replica_ejections(routers: SampleStore, scope: Scope) -> dict[str, float]:
    """Replica name -> the routers' ``ferry_router_ejections_total`` for it (latest values, summed over routers
    and reasons) for the pool of ``scope`` (its ``pool`` label); reconcile restarts a replica ejected again and
    again. Empty when no router reports ejections for the pool."""
    totals: dict[str, float] = {}
    for labels, samples in routers.view(Scope(scope.pool, label=scope.label)).series(m.ROUTER_EJECTIONS, ()):
        name = labels.get(m.LABEL_REPLICA)
        if name and samples:
            totals[name] = totals.get(name, 0.0) + samples[-1][1]
    return totals


class TelemetryPoller:
    """One poller. ``clock`` returns Unix seconds; ``endpoints`` lists replica endpoints, ``routers``
    the routers to scrape; ``router_source`` scrapes them (default: a ``DirectScrapeSource``)."""

    def __init__(
        self,
        *,
        history: SignalHistory | None = None,
        window_s: float = 30.0,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        endpoints: Callable[[], Iterable[ReplicaEndpoint]] = replica_endpoints,
        source_factory: Callable[..., MetricSource] = default_source_factory,
        routers: Callable[[], Iterable[RouterEndpoint]] = router_endpoints,
        router_source: DirectScrapeSource | None = None,
        slow_every: int = 5,
    ):
        if window_s <= 0 or interval_s <= 0:
            raise ValueError("window_s and interval_s must be positive")
        self.history = history or SignalHistory()
        self.window_s = window_s
        self.interval_s = interval_s
        self._clock = clock
        self._endpoints = endpoints
        self._source_factory = source_factory
        self._routers = routers
        self.router_source = router_source or DirectScrapeSource(retention_s=scrape_retention_s(window_s))
        self.sources: dict[tuple, MetricSource] = {}
        self.evaluator = AlertEvaluator()
        self.key_uses = KeyUseCounter()
        self.slow_every = slow_every
        """Collect the slow-request timelines every this many polls (0: never)."""
        self._num_polls = 0
        self.link_load: dict | None = None
        """The last poll's link-load document (:mod:`apps.telemetry.link_load`)."""
        for alert in Alert.objects.filter(state=Alert.State.FIRING):
            self.evaluator.restore_firing(str(alert.rule_id), str(alert.pool_id), alert.started_at.timestamp())

    def _source(self, choice: SourceChoice) -> MetricSource:
        if choice.key not in self.sources:
            self.sources[choice.key] = self._source_factory(choice, window_s=self.window_s,
                                                            routers=self.router_source.store)
        return self.sources[choice.key]

    def poll_once(self) -> dict[int, dict]:
        """Run one poll; returns pool id -> the record broadcast to the pool's group."""
        now = self._clock()
        targets = poll_targets()
        endpoints = list(self._endpoints())
        routers = list(self._routers())
        if routers or any(t.source.kind == "scrape" for t in targets):
            self.router_source.refresh(routers, now)
        uses = self.key_uses.increase(self.router_source.store)
        if uses:
            client_key_uses_record(uses=uses, at=datetime.fromtimestamp(now, tz=UTC))
        for choice in {t.source for t in targets}:
            pool_ids = {str(t.pool_id) for t in targets if t.source == choice}
            self._source(choice).refresh([e for e in endpoints if str(e.pool_id) in pool_ids], now)
        rules = alert_rules_effective([t.pool_id for t in targets])
        records: dict[int, dict] = {}
        for target in targets:
            source = self._source(target.source)
            try:
                pool_set = source.signals(target.scope(), window_s=self.window_s, at_s=now)
                tracks = {
                    name: source.signals(target.scope(name), window_s=self.window_s, at_s=now).values
                    for name in target.tracks
                }
                kv_transfers = source.kv_transfers(target.scope(), window_s=self.window_s, at_s=now)
            except MetricSourceError as exc:
                logger.warning("pool %s: %s", target.pool_id, exc)
                continue
            measured = dict(zip(SIGNAL_PARTS, significant([pool_set.values, tracks, kv_transfers]), strict=True))
            record = {"pool_id": target.pool_id, "at": now, "window_s": self.window_s, "source": source.name,
                      **measured, "ejections": replica_ejections(self.router_source.store, target.scope())}
            message = telemetry_broadcast(pool_group(target.pool_id), "telemetry.signals", record, history=self.history)
            self.history.append(history_scope(target.pool_id), now, message)
            records[target.pool_id] = message
            specs = [
                RuleSpec(key=str(r.pk), name=r.name, signal=r.signal, comparison=r.comparison,
                         threshold=r.threshold, for_seconds=r.for_seconds, severity=r.severity)
                for r in rules.get(target.pool_id, [])
            ]
            transitions = self.evaluator.evaluate(specs, str(target.pool_id), pool_set.values, now)
            if transitions:
                alert_transitions_apply(pool_id=target.pool_id, transitions=transitions, history=self.history)
        self.link_load = link_load_document(records, at_s=now, window_s=self.window_s)
        link_load_store(self.link_load)
        self._num_polls += 1
        if self.slow_every and self._num_polls % self.slow_every == 1 % self.slow_every:
            self.collect_slow(endpoints, now)
        fleet = {"at": now, "window_s": self.window_s,
                 "pools": {str(pid): rec["signals"] for pid, rec in records.items()}}
        message = telemetry_broadcast(FLEET_GROUP, "telemetry.fleet", fleet, history=self.history)
        self.history.replace(history_scope(None), now, message)  # only the newest fleet record is ever read
        return records

    def collect_slow(self, endpoints: list[ReplicaEndpoint], now: float) -> dict[str, list[dict]]:
        """Read every replica's and router's slow requests and store each pool's rows (1 s timeout each)."""
        with httpx.Client(timeout=1.0) as client:
            rows = collect_slow_requests(endpoints, list(self._routers()), client=client)
        for pool_id, pool_rows in rows.items():
            slow_requests_store(self.history, pool_id=pool_id, at_s=now, rows=pool_rows)
        return rows

    def run(self, stop: threading.Event, *, max_polls: int | None = None) -> int:
        """Poll every ``interval_s`` until ``stop`` is set (or ``max_polls``); returns polls done.

        Database and Redis outages are logged and retried on the next tick, never fatal.
        """
        done = 0
        while not stop.is_set() and (max_polls is None or done < max_polls):
            started = time.monotonic()
            loop_iteration_started()  # the query log and old connections, as a request would
            try:
                self.poll_once()
            except (DatabaseError, redis.RedisError) as exc:
                logger.warning("telemetry poll failed, retrying next tick: %s", exc)
            done += 1
            stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        return done

    def close(self) -> None:
        for source in self.sources.values():
            source.close()
        self.router_source.close()
