"""Filters for ``/api/v1/profiles/`` and ``/api/v1/plans/``."""

import django_filters
from django.db.models import Q

from apps.core.filters import FilterSet
from apps.planning.models import PlanResult, Profile


class ProfileFilterSet(FilterSet):
    class Meta:
        model = Profile
        fields = ["model_version", "pool_kind", "pool", "source"]


class PlanResultFilterSet(FilterSet):
    pool = django_filters.NumberFilter(method="filter_pool")

    class Meta:
        model = PlanResult
        fields = []

    def filter_pool(self, queryset, name, value):  # noqa: ANN001, ANN201 - django-filter signature
        return queryset.filter(Q(scenario__prefill_pool=value) | Q(scenario__decode_pool=value))
