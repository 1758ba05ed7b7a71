"""Filters for ``/api/v1/actions/``."""

import django_filters

from apps.core.filters import FilterSet
from apps.operations.models import Action


class ActionFilterSet(FilterSet):
    requested_by = django_filters.CharFilter(field_name="requested_by__username")
    requester = django_filters.CharFilter(
        field_name="requester",
        help_text="Who asked (exact): a user's name, autoscaler, rollout:<id>, reconcile or system.")
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Action
        fields = ["status", "kind", "target_type", "target_id", "pool", "retry_of"]
