"""Filters for ``/api/v1/rollouts/``."""

import django_filters

from apps.core.filters import FilterSet
from apps.rollouts.models import GateMeasurement, RolloutPlan


class RolloutPlanFilterSet(FilterSet):
    pool = django_filters.NumberFilter(field_name="pools", distinct=True)

    class Meta:
        model = RolloutPlan
        fields = ["name", "state", "strategy", "target_model_version"]


class GateMeasurementFilterSet(FilterSet):
    class Meta:
        model = GateMeasurement
        fields = ["rollout", "pool", "passed", "signal", "step_index"]
