"""Filters for ``/api/v1/model-versions/``."""

import django_filters

from apps.catalog.models import ModelVersion
from apps.core.filters import FilterSet


class ModelVersionFilterSet(FilterSet):
    name = django_filters.CharFilter()
    name_contains = django_filters.CharFilter(field_name="name", lookup_expr="icontains")

    class Meta:
        model = ModelVersion
        fields = ["name", "version", "model_type", "num_key_value_heads", "sha256"]
