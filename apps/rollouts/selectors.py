"""Reads for rollout plans."""

from __future__ import annotations

from django.db.models import QuerySet

from apps.fleet.models import Pool
from apps.rollouts.models import GateMeasurement, RolloutPlan


def rollout_list() -> QuerySet[RolloutPlan]:
    return RolloutPlan.objects.select_related("target_model_version", "created_by").prefetch_related("pools")


def rollout_active_for_pool(*, pool: Pool, exclude_id: int | None = None) -> RolloutPlan | None:
    """The pending/progressing/paused plan that includes ``pool``, if any."""
    qs = RolloutPlan.objects.filter(pools=pool, state__in=RolloutPlan.ACTIVE_STATES)
    if exclude_id is not None:
        qs = qs.exclude(pk=exclude_id)
    return qs.first()


def gate_measurement_list() -> QuerySet[GateMeasurement]:
    return GateMeasurement.objects.all()
