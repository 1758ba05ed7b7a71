"""Celery task ``telemetry.prune_alerts``: delete resolved alerts past their retention (idempotent).

The poller itself is not a Celery task: it runs as its own process (``manage.py telemetry``).
"""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from apps.telemetry import services


@shared_task(name="telemetry.prune_alerts", ignore_result=True, soft_time_limit=60, time_limit=90)
def prune_alerts() -> int:
    """Delete alerts resolved more than ``FERRY_ALERT_RETENTION_S`` (default 30 days) ago."""
    return services.alerts_prune(older_than_s=getattr(settings, "FERRY_ALERT_RETENTION_S", 30 * 86400))
