"""Filters for the telemetry endpoints."""

import django_filters

from apps.core.filters import FilterSet
from apps.telemetry.models import Alert, AlertRule


class AlertRuleFilterSet(FilterSet):
    fleet_default = django_filters.BooleanFilter(field_name="pool", lookup_expr="isnull")

    class Meta:
        model = AlertRule
        fields = ["name", "pool", "signal", "severity", "enabled"]


class AlertFilterSet(FilterSet):
    rule_name = django_filters.CharFilter(field_name="rule__name")

    class Meta:
        model = Alert
        fields = ["pool", "state", "severity", "rule"]
