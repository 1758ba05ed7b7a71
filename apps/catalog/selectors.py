"""Reads for the catalog."""

from django.db.models import QuerySet

from apps.catalog.models import ModelVersion


def model_version_list() -> QuerySet[ModelVersion]:
    """All model versions (no relations to prefetch)."""
    return ModelVersion.objects.all()
