"""Celery task ``operations.execute_action``: claim an Action, run its handler, record the outcome.

Routed to the ``operations`` queue by ``CELERY_TASK_ROUTES``. Idempotent: the claim is a conditional update (pending -> running), so a duplicate delivery
(Redis redelivers after its visibility timeout) finds the row no longer pending and does nothing.
"""

from __future__ import annotations

from celery import shared_task

from apps.operations import services
from apps.operations.handlers import HANDLERS, ActionError
from apps.operations.models import Action


@shared_task(name="operations.execute_action", acks_late=True, ignore_result=True,
             soft_time_limit=300, time_limit=360)
def execute_action(action_id: int) -> str:
    """Run Action ``action_id``; returns ``"skipped"``, ``"succeeded"`` or ``"failed"``."""
    if not services.action_claim(action_id=action_id):
        return "skipped"
    action = Action.objects.get(pk=action_id)
    handler = HANDLERS.get(action.kind)
    if handler is None:
        services.action_finish(action_id=action_id, succeeded=False,
                               error=f"no handler is registered for action kind {action.kind!r}")
        return "failed"
    try:
        handler(action)
    except ActionError as exc:
        services.action_finish(action_id=action_id, succeeded=False, error=str(exc))
        return "failed"
    except Exception as exc:
        services.action_finish(action_id=action_id, succeeded=False, error=f"{type(exc).__name__}: {exc}")
        raise
    services.action_finish(action_id=action_id, succeeded=True)
    return "succeeded"
