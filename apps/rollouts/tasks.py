"""Celery tasks of rollouts (thin: ids in, the controller does the work).

* ``rollouts.tick`` (beat, every ``FERRY_ROLLOUT_TICK_S``): find rollouts that are due — progressing
  with ``next_step_at`` in the past, or aborted/failed ones still cleaning up — and advance each
  once. No long countdowns: a rollout that waits stores ``next_step_at`` and the next tick moves it.
* ``rollouts.advance(rollout_id, step_index)``: advance one rollout if it is still at ``step_index``
  (sent by name after a verb commits, :func:`apps.rollouts.services.rollout_advance_enqueue`, so the
  rollout moves without waiting for beat). Idempotent — the
  controller claims a step with a conditional update on ``(id, state, current_step_index)`` — hence
  ``acks_late``: a redelivered message finds the index moved and does nothing.
"""

from __future__ import annotations

from celery import shared_task
from django.db.models import Q
from django.utils import timezone

from apps.rollouts import transitions
from apps.rollouts.controller import rollout_tick
from apps.rollouts.models import RolloutPlan


@shared_task(name="rollouts.advance", acks_late=True, ignore_result=True, soft_time_limit=120, time_limit=150)
def rollout_advance(rollout_id: int, step_index: int | None = None) -> str:
    """Advance rollout ``rollout_id`` once if it is still at ``step_index``; returns the outcome word."""
    return rollout_tick(rollout_id=rollout_id, step_index=step_index)


def rollouts_due(now=None) -> list[tuple[int, int]]:  # noqa: ANN001 - datetime
    """``(id, current_step_index)`` of rollouts due for a tick (progressing and due, or cleaning up)."""
    now = now or timezone.now()
    due = RolloutPlan.objects.filter(
        Q(state=transitions.PROGRESSING) | Q(state__in=(transitions.ABORTED, transitions.FAILED),
                                             progress__cleanup=True),
    ).filter(Q(next_step_at__isnull=True) | Q(next_step_at__lte=now))
    return list(due.order_by("id").values_list("id", "current_step_index"))


@shared_task(name="rollouts.tick", ignore_result=True, soft_time_limit=120, time_limit=150)
def rollouts_tick() -> dict[str, int]:
    """Advance every due rollout once; returns counts by outcome."""
    counts: dict[str, int] = {}
    for rollout_id, index in rollouts_due():
        outcome = rollout_tick(rollout_id=rollout_id, step_index=index)
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts
