"""Reads for telemetry: poll targets, effective alert rules, alerts, signal history and snapshots."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from django.conf import settings
from django.db.models import OuterRef, Prefetch, Subquery
from django.utils import timezone

from apps.fleet.models import Cluster, Pool, PoolTrack
from apps.fleet.routing_table_cache import link_load_read
from apps.telemetry.history import SignalHistory
from apps.telemetry.models import Alert, AlertRule, AlertSilence, MetricSourceConfig
from apps.telemetry.signals import SIGNAL_SPECS, Scope


@dataclass(frozen=True)
class SourceChoice:
    """How to read one cluster: ``kind`` scrape|prometheus, Prometheus URL, DCGM on/off."""

    kind: str
    prometheus_url: str = ""
    dcgm: bool = False
    namespace: str = ""
    cluster_id: int | None = None  # direct scrape keeps one source (sample store) per cluster

    @property
    def key(self) -> tuple:
        return (self.kind, self.prometheus_url, self.dcgm, self.namespace, self.cluster_id)


@dataclass(frozen=True)
class PoolTarget:
    """A pool the poller reads: id, ``pool`` label value (its name), tracks and its cluster's source."""

    pool_id: int
    label: str
    tracks: tuple[str, ...]
    source: SourceChoice
    engine: str = "ferry"

    def scope(self, track: str | None = None) -> Scope:
        """The pool's scope for its source: Prometheus selects by the workers' ``pool`` label (the
        pool's name, as the orchestrator passes ``--pool``); direct scrape by endpoint pool id, and
        router series (labelled with the pool's name) by that label. ``engine``: the pool's engine kind."""
        if self.source.kind == "prometheus":
            return Scope(self.label, track, engine=self.engine)
        return Scope(str(self.pool_id), track, label=self.label, engine=self.engine)


def metric_source_choice(cluster: Cluster) -> SourceChoice:
    """The cluster's configured source; default: Prometheus at ``FERRY_PROMETHEUS_URL`` for
    Kubernetes clusters when that setting is non-empty, else direct scrape."""
    try:
        config = cluster.metric_source
    except MetricSourceConfig.DoesNotExist:
        config = None
    kubernetes = cluster.kind == Cluster.Kind.KUBERNETES
    if config is not None:
        if config.kind == MetricSourceConfig.Kind.PROMETHEUS:
            return SourceChoice("prometheus", config.prometheus_url, kubernetes and config.dcgm_gpu_metrics,
                                cluster.namespace)
        return SourceChoice("scrape", cluster_id=cluster.pk)
    default_url = getattr(settings, "FERRY_PROMETHEUS_URL", "")
    if kubernetes and default_url:
        return SourceChoice("prometheus", default_url, True, cluster.namespace)
    return SourceChoice("scrape", cluster_id=cluster.pk)


def poll_targets() -> list[PoolTarget]:
    """Every pool with its track names and its cluster's metric source (3 queries)."""
    pools = Pool.objects.select_related("cluster", "cluster__metric_source").prefetch_related(
        Prefetch("tracks", queryset=PoolTrack.objects.only("pool_id", "name"))
    )
    return [
        PoolTarget(pool.pk, pool.name, tuple(t.name for t in pool.tracks.all()),
                   metric_source_choice(pool.cluster), engine=pool.engine)
        for pool in pools
    ]


def alert_rules_effective(pool_ids: list[int]) -> dict[int, list[AlertRule]]:
    """Enabled rules per pool: fleet defaults, replaced by a pool rule of the same name.

    A disabled pool rule still replaces the default, which is how one pool turns a default off.
    """
    rules = list(AlertRule.objects.filter(pool__isnull=True) | AlertRule.objects.filter(pool_id__in=pool_ids))
    defaults = {r.name: r for r in rules if r.pool_id is None}
    out: dict[int, list[AlertRule]] = {}
    for pool_id in pool_ids:
        own = {r.name: r for r in rules if r.pool_id == pool_id}
        merged = {**defaults, **own}
        out[pool_id] = [r for _, r in sorted(merged.items()) if r.enabled]
    return out


def alert_list(*, pool_id: int | None = None, state: str | None = None):
    """Alerts, newest first, optionally for one pool and/or state, with their rule, the user who acknowledged
    them and ``silenced_until`` (the end of the latest silence of the alert's rule on its pool in effect now,
    else ``None``): one query for any number of alerts."""
    now = timezone.now()
    silence = (AlertSilence.objects.filter(rule_id=OuterRef("rule_id"), pool_id=OuterRef("pool_id"),
                                           starts_at__lte=now, ends_at__gt=now)
               .order_by("-ends_at").values("ends_at")[:1])
    qs = Alert.objects.select_related("rule", "acknowledged_by").annotate(silenced_until=Subquery(silence))
    if pool_id is not None:
        qs = qs.filter(pool_id=pool_id)
    if state is not None:
        qs = qs.filter(state=state)
    return qs


def history_scope(pool_id: int | None) -> str:
    """The history key of a pool (``pool:<id>``) or of the fleet (``fleet``)."""
    return "fleet" if pool_id is None else f"pool:{pool_id}"


def telemetry_history(*, pool_id: int | None = None, since_s: float | None = None,
                      history: SignalHistory | None = None) -> list[dict]:
    """Signal records of a pool (or the fleet) from the last 15 minutes, oldest first."""
    history = history or SignalHistory()
    floor = time.time() - history.horizon_s
    return history.read(history_scope(pool_id), since_s=max(floor, since_s or floor))


def telemetry_snapshot(*, pool_id: int | None = None, history: SignalHistory | None = None) -> dict | None:
    """The newest record of a pool (or the fleet), with its ``seq``; ``None`` before the first poll."""
    history = history or SignalHistory()
    return history.latest(history_scope(pool_id))


def telemetry_histories(*, pool_ids: list[int], since_s: float | None = None,
                        history: SignalHistory | None = None) -> dict[int, list[dict]]:
    """:func:`telemetry_history` of several pools in one Redis round trip: pool id -> records, oldest first."""
    history = history or SignalHistory()
    floor = time.time() - history.horizon_s
    found = history.read_many([history_scope(p) for p in pool_ids], since_s=max(floor, since_s or floor))
    return {p: found[history_scope(p)] for p in pool_ids}


def telemetry_snapshots(*, pool_ids: list[int], history: SignalHistory | None = None) -> dict[int, dict | None]:
    """:func:`telemetry_snapshot` of several pools in one Redis round trip: pool id -> newest record or ``None``."""
    history = history or SignalHistory()
    found = history.latest_many(history_scope(p) for p in pool_ids)
    return {p: found[history_scope(p)] for p in pool_ids}


def telemetry_signal(*, pool_id: int, name: str, track: str | None = None, max_age_s: float = 10.0,
                     history: SignalHistory | None = None, now_s: float | None = None) -> float | None:
    """The latest value of signal ``name`` for a pool (or one of its tracks), for the autoscaler and gates.

    ``None`` when there is no data: no record yet, a record older than ``max_age_s`` (the poller
    stopped), an unknown track, or the signal itself had no data. ``None`` does not say why: a
    latency quantile is also ``None`` for an idle pool, whose ``request_rate_per_s`` reads ``0.0``
    (``apps.telemetry.signals``). Raises ``KeyError`` for an unknown signal name.
    """
    if name not in SIGNAL_SPECS:
        raise KeyError(f"unknown signal {name!r}; known: {', '.join(SIGNAL_SPECS)}")
    record = telemetry_snapshot(pool_id=pool_id, history=history)
    now_s = time.time() if now_s is None else now_s
    if record is None or now_s - record["at"] > max_age_s:
        return None
    values = record["signals"] if track is None else record.get("tracks", {}).get(track)
    return None if values is None else values.get(name)


def link_load_current() -> dict | None:
    """The links' measured KV load the poller stored last (:mod:`apps.telemetry.link_load`), or None when none is
    current (no poller running, or its last document expired)."""
    body = link_load_read()
    return None if body is None else json.loads(body)
