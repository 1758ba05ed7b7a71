"""The autoscaler's evaluation over the database and telemetry (``operations.autoscale`` from beat).

For each pool with autoscaling on or schedule windows: read the pool's latest telemetry record
(``apps.telemetry.selectors.telemetry_snapshot``; older than ``FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S``
counts as no data) and, when a latency signal has no value, whether the pool was idle over the
scale-down stabilization window (its request-rate history, ``autoscale_math.idle_throughout``), run the pure :func:`apps.operations.autoscale_math.decide`, keep its
recommendations in ``AutoscalerState``, and when it changes the total request a ``pool.scale``
Action whose params carry the reason. A busy pool (an Action pending or running) is skipped.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime

from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.utils import timezone

from apps.core.errors import ConflictError
from apps.fleet.models import Pool
from apps.operations.autoscale_math import (
    LATENCY_SIGNALS,
    SIGNAL_NAMES,
    Decision,
    Observation,
    Policy,
    RateRecord,
    ScheduleWindow,
    decide,
    idle_throughout,
)
from apps.operations.models import Action, AutoscalerState
from apps.operations.pools import pool_scale_by_system
from apps.telemetry.history import SignalHistory
from apps.telemetry.selectors import telemetry_histories, telemetry_snapshots

logger = logging.getLogger(__name__)


def pool_policy(pool: Pool) -> Policy:
    """The pure policy of a pool (its autoscaling fields and schedule windows)."""
    return Policy(
        enabled=pool.autoscaling_enabled, min_replicas=pool.min_replicas, max_replicas=pool.max_replicas,
        signal=pool.autoscaling_signal, target=pool.autoscaling_target,
        scale_up_stabilization_s=pool.scale_up_stabilization_s,
        scale_down_stabilization_s=pool.scale_down_stabilization_s,
        windows=tuple(ScheduleWindow.from_dict(w) for w in pool.schedule_overrides),
        time_zone=pool.schedule_time_zone,
    )


def pool_signals(pool: Pool, *, now_s: float,
                 history: SignalHistory | None = None) -> tuple[float | None, int | None, bool]:
    """``(value of the pool's signal, ready replicas, idle)`` from the telemetry records, or ``(None, None, False)``.

    ``idle`` is only computed when the signal is a latency signal without a value (the rule in
    ``autoscale_math``): the records of the last ``scale_down_stabilization_s`` (plus one allowed
    gap) are read from the signal history; records at most ``FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S``
    apart count as continuous. One pool of :func:`pools_signals`.
    """
    return pools_signals([pool], now_s=now_s, history=history)[pool.pk]


def pools_signals(pools: list[Pool], *, now_s: float,
                  history: SignalHistory | None = None) -> dict[int, tuple[float | None, int | None, bool]]:
    """:func:`pool_signals` of several pools (pool id -> the triple) in at most two Redis round trips: the
    newest record of every pool, then the request-rate history of the pools whose latency signal has no value.
    """
    history = history or SignalHistory()
    latest = telemetry_snapshots(pool_ids=[pool.pk for pool in pools], history=history)
    max_age_s = getattr(settings, "FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S", 30.0)
    out: dict[int, tuple[float | None, int | None, bool]] = {}
    idle_check: list[Pool] = []
    for pool in pools:
        record = latest[pool.pk]
        if not record or now_s - float(record.get("at", 0)) > max_age_s:
            out[pool.pk] = (None, None, False)
            continue
        signals = record.get("signals") or {}
        ready = signals.get("ready_replicas")
        value = signals.get(SIGNAL_NAMES[pool.autoscaling_signal])
        out[pool.pk] = (value, None if ready is None else int(ready), False)
        if value is None and pool.autoscaling_signal in LATENCY_SIGNALS:
            idle_check.append(pool)
    by_window: dict[float, list[Pool]] = {}
    for pool in idle_check:
        by_window.setdefault(float(pool.scale_down_stabilization_s), []).append(pool)
    for window_s, group in by_window.items():
        found = telemetry_histories(pool_ids=[p.pk for p in group], since_s=now_s - window_s - max_age_s,
                                    history=history)
        for pool in group:
            records = [
                RateRecord(float(r["at"]), str(r.get("source", "")),
                           (r.get("signals") or {}).get("request_rate_per_s"),
                           (r.get("signals") or {}).get("ready_replicas"))
                for r in found[pool.pk]
            ]
            value, ready, _ = out[pool.pk]
            out[pool.pk] = (value, ready, idle_throughout(records, now_s=now_s, window_s=window_s,
                                                          max_gap_s=max_age_s))
    return out


def _evaluate(pool: Pool, state: AutoscalerState, *, now: datetime, value: float | None,
              ready_replicas: int | None, idle: bool) -> tuple[Decision, Action | None]:
    """Decide for ``pool``, update ``state`` in memory (the caller saves it) and request the ``pool.scale``
    Action when the total changes."""
    current = pool.replicas
    obs = Observation(now=now, current_replicas=current, ready_replicas=ready_replicas, value=value,
                      base_replicas=state.base_replicas, idle=idle)
    decision = decide(pool_policy(pool), obs, [tuple(r) for r in state.recommendations])
    state.recommendations = [list(r) for r in decision.recommendations]
    state.last_value, state.last_reason, state.evaluated_at = value, decision.reason, now
    state.base_replicas = decision.base_replicas
    action = None
    if decision.changes:
        latest = Action.objects.filter(pool=pool).order_by("-id").values_list("id", flat=True).first() or 0
        try:
            action, _ = pool_scale_by_system(pool=pool, replicas=decision.replicas, reason=decision.reason,
                                             idempotency_key=f"autoscaler:pool-{pool.pk}:{decision.replicas}"
                                                             f":after-{latest}")
            state.last_replicas = decision.replicas
        except ConflictError:
            logger.info("pool %s busy; autoscaler decision %s deferred", pool, decision.replicas)
    return decision, action


def autoscaler_states_save(states: list[AutoscalerState]) -> int:
    """Write what an evaluation changes (recommendations, last value/reason/replicas, evaluated_at, base) of ``states`` (rows that exist) in one ``UPDATE ... FROM unnest(...)``;
    returns the rows updated.

    Django's ``bulk_update`` builds a ``CASE WHEN id = ... THEN ...`` expression per row and field, whose
    construction took seconds of CPU for 1,000 rows; PostgreSQL's ``unnest`` of one array per column sends the
    same values as 7 parameters.
    """
    if not states:
        return 0
    table = connection.ops.quote_name(AutoscalerState._meta.db_table)
    sql = (f"UPDATE {table} AS s SET recommendations = v.recommendations, last_value = v.last_value, "
           "last_reason = v.last_reason, evaluated_at = v.evaluated_at, base_replicas = v.base_replicas, "
           "last_replicas = v.last_replicas "
           "FROM unnest(%s::bigint[], %s::jsonb[], %s::float8[], %s::text[], %s::timestamptz[], %s::bigint[], "
           "%s::bigint[]) AS v(id, recommendations, last_value, last_reason, evaluated_at, base_replicas, "
           "last_replicas) WHERE s.id = v.id")
    def number(value, kind):  # one element type per array (psycopg cannot dump a list of int and float)
        return None if value is None else kind(value)

    params = [[s.pk for s in states], [json.dumps(s.recommendations) for s in states],
              [number(s.last_value, float) for s in states], [s.last_reason for s in states],
              [s.evaluated_at for s in states], [number(s.base_replicas, int) for s in states],
              [number(s.last_replicas, int) for s in states]]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def pool_autoscale(pool: Pool, *, now: datetime | None = None, value: float | None = None,
                   ready_replicas: int | None = None, idle: bool = False, read_signals: bool = True,
                   history: SignalHistory | None = None) -> tuple[Decision, Action | None]:
    """Evaluate one pool; returns the decision and the ``pool.scale`` Action it requested (or None).

    With ``read_signals`` False the given ``value``/``ready_replicas``/``idle`` are used (tests,
    what-if); otherwise they are read from ``history`` (default: the Redis signal history).
    """
    now = now or timezone.now()
    if read_signals:
        value, ready_replicas, idle = pool_signals(pool, now_s=now.timestamp(), history=history)
    state, _ = AutoscalerState.objects.get_or_create(pool=pool)
    decision, action = _evaluate(pool, state, now=now, value=value, ready_replicas=ready_replicas, idle=idle)
    state.save()
    return decision, action


def autoscale_all(*, history: SignalHistory | None = None) -> dict:
    """Evaluate every pool with autoscaling on or schedule windows; returns counts.

    Batched so the statement count does not grow with the number of pools (a pool whose total changes adds
    the queries of its ``pool.scale`` Action): the pools with their tracks (2 queries), the busy ones (1), their
    ``AutoscalerState`` rows (1, plus an insert and a read of the missing), their signals (:func:`pools_signals`, Redis),
    and one update of the evaluated states (:func:`autoscaler_states_save`). ``history``: default the Redis signal history.
    """
    started = time.monotonic()
    now = timezone.now()
    pools = list(Pool.objects.filter(Q(autoscaling_enabled=True) | ~Q(schedule_overrides=[]))
                 .select_related("cluster").prefetch_related("tracks"))
    busy_ids = set(Action.objects.filter(pool_id__in=[p.pk for p in pools], status__in=Action.ACTIVE_STATUSES)
                   .values_list("pool_id", flat=True)) if pools else set()
    ready = [pool for pool in pools if pool.pk not in busy_ids]
    states = {s.pool_id: s for s in AutoscalerState.objects.filter(pool_id__in=[p.pk for p in ready])}
    missing = [AutoscalerState(pool=pool) for pool in ready if pool.pk not in states]
    if missing:  # a tick running alongside may insert some of them too: keep its rows
        AutoscalerState.objects.bulk_create(missing, ignore_conflicts=True)
        states.update((s.pool_id, s) for s in AutoscalerState.objects.filter(pool_id__in=[m.pool_id for m in missing]))
    signals = pools_signals(ready, now_s=now.timestamp(), history=history) if ready else {}
    requested = 0
    for pool in ready:
        value, ready_replicas, idle = signals[pool.pk]
        _, action = _evaluate(pool, states[pool.pk], now=now, value=value, ready_replicas=ready_replicas, idle=idle)
        requested += action is not None
    autoscaler_states_save([states[p.pk] for p in ready])
    return {"evaluated": len(ready), "requested": requested, "busy": len(busy_ids),
            "seconds": round(time.monotonic() - started, 3)}
