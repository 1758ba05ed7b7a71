"""``manage.py ferry_probe``: exit 0 when the database and Redis answer, else 1 naming what is down.

The liveness/readiness probe of the control-plane processes that serve no HTTP (Celery beat, the
telemetry poller) on Kubernetes; the same checks as ``GET /healthz`` (:mod:`apps.core.views`).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from apps.core.views import check_database, check_redis


class Command(BaseCommand):
    help = "Exit 0 when the database and Redis answer (Kubernetes exec probe); 1 naming what is down."

    def handle(self, *args, **options) -> None:
        checks = {"database": check_database(), "redis": check_redis()}
        down = {name: state for name, state in checks.items() if state != "ok"}
        if down:
            raise CommandError("; ".join(f"{name} {state}" for name, state in down.items()))
        self.stdout.write("database ok; redis ok")
