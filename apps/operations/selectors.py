"""Reads for Actions."""

from django.db.models import Case, F, QuerySet, TextField, Value, When
from django.db.models.fields.json import KT
from django.db.models.functions import Coalesce, NullIf, Substr

from apps.operations.models import Action

REQUESTED_BY_PREFIX = "requested by "
"""The first log line :func:`apps.operations.services.action_create` writes: ``requested by <who>``."""


def action_requester_expression() -> Coalesce:
    """SQL for who asked for an Action, the same answer as :func:`apps.operations.services.action_requester`:
    the user's name, else ``params["requester"]`` (``autoscaler``, ``rollout:7``, ``reconcile``), else what
    follows ``requested by `` in the first log line, else ``system``."""
    first_line = KT("log__0__message")
    from_log = Case(When(log__0__message__startswith=REQUESTED_BY_PREFIX,
                         then=Substr(first_line, len(REQUESTED_BY_PREFIX) + 1)), default=None,
                    output_field=TextField())
    return Coalesce(F("requested_by__username"), NullIf(KT("params__requester"), Value("")),
                    NullIf(from_log, Value("")), Value("system"), output_field=TextField())


def action_list() -> QuerySet[Action]:
    """Actions with the relations the API and admin show, in one query, annotated with ``requester``
    (:func:`action_requester_expression`)."""
    return (Action.objects.select_related("requested_by", "pool", "pool__cluster", "retry_of")
            .annotate(requester=action_requester_expression()))
