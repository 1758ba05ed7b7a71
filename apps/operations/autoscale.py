"""The autoscaler's evaluation over the database and telemetry (``operations.autoscale`` from beat).

For each pool with autoscaling on or schedule windows: read the pool's latest telemetry record
(``apps.telemetry.selectors.telemetry_snapshot``; older than ``FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S``
counts as no data), run the pure :func:`apps.operations.autoscale_math.decide`, keep its
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
from apps.operations.autoscale_math import SIGNAL_NAMES, Decision, Observation, Policy, ScheduleWindow, decide
from apps.operations.models import Action, AutoscalerState
from apps.operations.pools import pool_scale_by_system
from apps.telemetry.selectors import telemetry_snapshot

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


def pool_signals(pool: Pool, *, now_s: float) -> tuple[float | None, int | None]:
    """``(value of the pool's signal, ready replicas)`` from the latest telemetry record, or Nones."""
    record = telemetry_snapshot(pool_id=pool.pk)
    max_age_s = getattr(settings, "FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S", 30.0)
    if not record or now_s - float(record.get("at", 0)) > max_age_s:
        return None, None
    signals = record.get("signals") or {}
    ready = signals.get("ready_replicas")
    return signals.get(SIGNAL_NAMES[pool.autoscaling_signal]), None if ready is None else int(ready)


def pool_autoscale(pool: Pool, *, now: datetime | None = None, value: float | None = None,
                   ready_replicas: int | None = None, read_signals: bool = True) -> tuple[Decision, Action | None]:
    """Evaluate one pool; returns the decision and the ``pool.scale`` Action it requested (or None).

    With ``read_signals`` False the given ``value``/``ready_replicas`` are used (tests, what-if).
    """
    now = now or timezone.now()
    if read_signals:
        value, ready_replicas = pool_signals(pool, now_s=now.timestamp())
    state, _ = AutoscalerState.objects.get_or_create(pool=pool)
    current = pool.replicas
    obs = Observation(now=now, current_replicas=current, ready_replicas=ready_replicas, value=value,
                      base_replicas=state.base_replicas)
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
