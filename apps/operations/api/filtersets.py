"""Filters for ``/api/v1/actions/``."""

import django_filters
from django.db.models import Q
from drf_spectacular.drainage import set_override

from apps.core.filters import FilterSet, IntegerFilter
from apps.operations.models import Action

POOL_ID_RANGE = (1, 2**63 - 1)  # a pool's BigAutoField key


class ActionFilterSet(FilterSet):
    requested_by = django_filters.CharFilter(field_name="requested_by__username")
    requester = django_filters.CharFilter(
        field_name="requester",
        help_text="Who asked (exact): a user's name, autoscaler, rollout:<id>, reconcile or system.")
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")
    about_pool = IntegerFilter(
        method="filter_about_pool", min_value=POOL_ID_RANGE[0], max_value=POOL_ID_RANGE[1],
        help_text="Every Action about this pool (id): those holding the pool's lock (``pool``: scale, apply, flush, "
                  "replica restarts) and those targeting it without the lock (``target_type=pool``: a rollout's "
                  "pool.track_set / pool.track_delete, which ``pool`` does not match).")
    set_override(about_pool, "field", {"type": "integer", "minimum": POOL_ID_RANGE[0], "maximum": POOL_ID_RANGE[1]})

    class Meta:
        model = Action
        fields = ["status", "kind", "target_type", "target_id", "pool", "retry_of"]

    def filter_about_pool(self, queryset, name: str, value: int):  # noqa: ANN001, ANN201 - django-filter signature
        return queryset.filter(Q(pool_id=value) | Q(target_type="pool", target_id=str(value)))
