"""Celery tasks of operations (thin: ids in, services/execution do the work).

* ``operations.execute_action`` (queue ``operations``): claim an Action and run its handler. Idempotent
  (the claim is a conditional update, so a redelivery does nothing), hence ``acks_late``. Retryable
  backend failures are retried with exponential backoff (:func:`execution.retry_countdown_s`). Time
  limits (soft 900 s, hard 960 s) bound one attempt: a longer drain or wait fails the Action as
  retryable. Liveness is the lease heartbeat's job, not the time limit's.
* ``operations.reconcile`` (queue ``reconcile``, beat every few seconds): take over expired leases,
  re-enqueue lost Actions, observe every pool, refresh ``Replica`` rows, converge desired vs observed
  through Actions, publish the routing table. Not ``acks_late``: a lost tick is replaced by the next.
* ``operations.autoscale`` (queue ``reconcile``, beat): one autoscaler evaluation of every pool.
"""

from __future__ import annotations

from celery import shared_task

from apps.operations.autoscale import autoscale_all
from apps.operations.execution import RetryLater, action_execute
from apps.operations.reconcile import reconcile_all

MAX_RETRIES = 5


@shared_task(bind=True, name="operations.execute_action", acks_late=True, ignore_result=True,
             max_retries=MAX_RETRIES, soft_time_limit=900, time_limit=960)
def execute_action(self, action_id: int) -> str:
    """Run Action ``action_id``; returns ``"skipped"``, ``"succeeded"``, ``"failed"`` or ``"lost-lease"``."""
    try:
        return action_execute(action_id=action_id, retries=self.request.retries, max_retries=self.max_retries)
    except RetryLater as exc:
        raise self.retry(countdown=exc.countdown_s, exc=exc) from exc


@shared_task(name="operations.reconcile", ignore_result=True, soft_time_limit=60, time_limit=90)
def reconcile() -> dict:
    """One reconcile tick over every pool; returns counts (see :func:`reconcile.reconcile_all`)."""
    return reconcile_all().as_dict()


@shared_task(name="operations.autoscale", ignore_result=True, soft_time_limit=60, time_limit=90)
def autoscale() -> dict:
    """One autoscaler evaluation of every pool with autoscaling or schedule windows."""
    return autoscale_all()
