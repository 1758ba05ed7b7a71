"""``manage.py ferry_beat_setup``: create or update Ferry's periodic tasks in django-celery-beat.

Idempotent: the PeriodicTask rows are keyed by name, so running it again updates the interval and
queue (an admin's ``enabled`` choice is kept). Intervals default to ``FERRY_RECONCILE_INTERVAL_S``
and ``FERRY_AUTOSCALE_INTERVAL_S``; edit them afterwards in the admin (Periodic tasks).
"""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

# name -> (task, queue, interval setting); every task also expires after one interval so a backlog
# (beat running while no worker consumes) does not fire a burst of stale ticks later.
PERIODIC_TASKS = {
    "ferry: reconcile": ("operations.reconcile", "reconcile", "FERRY_RECONCILE_INTERVAL_S"),
    "ferry: autoscale": ("operations.autoscale", "reconcile", "FERRY_AUTOSCALE_INTERVAL_S"),
}


def beat_setup() -> list[PeriodicTask]:
    """Create or update the periodic tasks; returns them."""
    tasks = []
    with transaction.atomic():
        for name, (task, queue, setting) in PERIODIC_TASKS.items():
            seconds = max(1, round(float(getattr(settings, setting))))
            every, _ = IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)
            periodic, _ = PeriodicTask.objects.update_or_create(name=name, defaults={
                "task": task, "interval": every, "queue": queue, "expire_seconds": seconds,
                "description": f"Ferry {task} every {seconds}s (created by ferry_beat_setup)",
            })
            tasks.append(periodic)
    return tasks


class Command(BaseCommand):
    help = "Create or update Ferry's periodic tasks (reconcile, autoscale) for celery beat."

    def handle(self, *args, **options) -> None:
        for task in beat_setup():
            state = "enabled" if task.enabled else "disabled"
            self.stdout.write(f"{task.name}: {task.task} every {task.interval.every}s on {task.queue} ({state})")
