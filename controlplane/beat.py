"""Celery beat's scheduler: django-celery-beat's ``DatabaseScheduler`` whose every tick starts like a request.

Beat runs for weeks and queries the schedule tables at each tick (a few seconds apart); with ``DEBUG`` on
every query stays in the connection's query log (:mod:`apps.core.process_loop`). ``CELERY_BEAT_SCHEDULER``
names this class.
"""

from __future__ import annotations

from django_celery_beat.schedulers import DatabaseScheduler

from apps.core.process_loop import loop_iteration_started


class Scheduler(DatabaseScheduler):
    """``DatabaseScheduler`` that calls :func:`~apps.core.process_loop.loop_iteration_started` before each tick."""

    def tick(self, *args, **kwargs):
        """One beat tick (``celery.beat.Scheduler.tick``): seconds until the next; the query log is emptied first."""
        loop_iteration_started()
        return super().tick(*args, **kwargs)
