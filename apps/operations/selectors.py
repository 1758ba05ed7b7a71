"""Reads for Actions."""

from django.db.models import QuerySet

from apps.operations.models import Action


def action_list() -> QuerySet[Action]:
    """Actions with the relations the API and admin show, in one query."""
    return Action.objects.select_related("requested_by", "pool", "pool__cluster", "retry_of")
