"""Filters for ``/api/v1/profiles/`` and ``/api/v1/plans/``."""

from django.db.models import Q

from apps.core.filters import FilterSet, IntegerFilter, integer_range
from apps.fleet.models import Pool
from apps.planning.models import PlanResult, Profile


class ProfileFilterSet(FilterSet):
    class Meta:
        model = Profile
        fields = ["model_version", "pool_kind", "pool", "source"]


class PlanResultFilterSet(FilterSet):
    pool = IntegerFilter(method="filter_pool", min_value=integer_range(Pool._meta.pk)[0],
                         max_value=integer_range(Pool._meta.pk)[1],
                         label="Plans whose prefill or decode pool is this pool.")

    class Meta:
        model = PlanResult
        fields = []

    def filter_pool(self, queryset, name, value):  # noqa: ANN001, ANN201 - django-filter signature
        return queryset.filter(Q(scenario__prefill_pool=value) | Q(scenario__decode_pool=value))
