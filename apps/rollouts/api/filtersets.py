"""Filters for ``/api/v1/rollouts/``."""

import django_filters

from apps.rollouts.models import RolloutPlan


class RolloutPlanFilterSet(django_filters.FilterSet):
    pool = django_filters.NumberFilter(field_name="pools", distinct=True)

    class Meta:
        model = RolloutPlan
        fields = ["name", "state", "strategy", "target_model_version"]
