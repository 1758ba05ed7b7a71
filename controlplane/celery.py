"""The Celery application: Redis broker from ``REDIS_URL``; settings under the ``CELERY_`` prefix.

Run a worker with ``celery -A controlplane worker -Q default,operations`` (tasks route by name:
``operations.*`` goes to the ``operations`` queue, see ``CELERY_TASK_ROUTES``).
"""

import os

from celery import Celery
from celery.signals import task_prerun, worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("ferry")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_process_init.connect
def _trace_tasks(**_kwargs) -> None:
    """Trace task runs when ``FERRY_TRACE_RATIO`` > 0 (:mod:`controlplane.tracing`); each prefork child sets up
    its own exporter (the SDK's batch thread does not survive a fork)."""
    if os.environ.get("FERRY_TRACE_RATIO"):
        from controlplane.tracing import instrument_celery

        instrument_celery()


@task_prerun.connect
def _start_task_like_a_request(task=None, **_kwargs) -> None:
    """Each task a worker runs starts as Django starts a request: an empty query log, no expired connection
    (:mod:`apps.core.process_loop`; with ``DEBUG`` on, the ``ticks`` worker's log grew for hours). An eager task
    runs inside its caller's request or test transaction, which keeps its connection and log (as Celery's
    Django fix-up leaves them too)."""
    if task is not None and getattr(task.request, "is_eager", False):
        return
    from apps.core.process_loop import loop_iteration_started

    loop_iteration_started()
