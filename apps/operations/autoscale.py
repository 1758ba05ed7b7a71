"""The autoscaler's evaluation over the database and telemetry (``operations.autoscale`` from beat).

For each pool with autoscaling on or schedule windows: read the pool's latest telemetry record
(``apps.telemetry.selectors.telemetry_snapshot``; older than ``FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S``
counts as no data) and, when a latency signal has no value, whether the pool was idle over the
scale-down stabilization window (its request-rate history, ``autoscale_math.idle_throughout``), run the pure :func:`apps.operations.autoscale_math.decide`, keep its
recommendations in ``AutoscalerState``, and when it changes the total request a ``pool.scale``
Action whose params carry the reason. A busy pool (an Action pending or running) is skipped.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

from django.conf import settings
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
from apps.telemetry.selectors import telemetry_history, telemetry_snapshot

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
    apart count as continuous.
    """
    history = history or SignalHistory()
    record = telemetry_snapshot(pool_id=pool.pk, history=history)
    max_age_s = getattr(settings, "FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S", 30.0)
    if not record or now_s - float(record.get("at", 0)) > max_age_s:
        return None, None, False
    signals = record.get("signals") or {}
    ready = signals.get("ready_replicas")
    value = signals.get(SIGNAL_NAMES[pool.autoscaling_signal])
    idle = False
    if value is None and pool.autoscaling_signal in LATENCY_SIGNALS:
        window_s = float(pool.scale_down_stabilization_s)
        records = [
            RateRecord(float(r["at"]), str(r.get("source", "")), (r.get("signals") or {}).get("request_rate_per_s"),
                       (r.get("signals") or {}).get("ready_replicas"))
            for r in telemetry_history(pool_id=pool.pk, since_s=now_s - window_s - max_age_s, history=history)
        ]
        idle = idle_throughout(records, now_s=now_s, window_s=window_s, max_gap_s=max_age_s)
    return value, None if ready is None else int(ready), idle


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
    state.save()
    return decision, action


def autoscale_all() -> dict:
    """Evaluate every pool with autoscaling on or schedule windows; returns counts."""
    started = time.monotonic()
    pools = (Pool.objects.filter(Q(autoscaling_enabled=True) | ~Q(schedule_overrides=[]))
             .select_related("cluster").prefetch_related("tracks"))
    evaluated = requested = busy = 0
    for pool in pools:
        if Action.objects.filter(pool=pool, status__in=Action.ACTIVE_STATUSES).exists():
            busy += 1
            continue
        _, action = pool_autoscale(pool)
        evaluated += 1
        requested += action is not None
    return {"evaluated": evaluated, "requested": requested, "busy": busy,
            "seconds": round(time.monotonic() - started, 3)}
