"""``manage.py telemetry_rules > rules.yml``: the alert rules as a Prometheus alerting-rules file."""

from __future__ import annotations

import yaml
from django.core.management.base import BaseCommand
from django.db.models import F

from apps.telemetry.alerts import RuleSpec, prometheus_rules
from apps.telemetry.models import AlertRule


class Command(BaseCommand):
    help = "Print the enabled alert rules (fleet defaults per pool, pool overrides) as a Prometheus rules file (for Alertmanager users)."

    def add_arguments(self, parser):
        parser.add_argument("--window", type=float, default=60.0, help="Range for rate() and quantiles, seconds.")

    def handle(self, *args, window: float, **options):
        pairs = [
            (RuleSpec(key=str(r.pk), name=r.name, signal=r.signal, comparison=r.comparison, threshold=r.threshold,
                      for_seconds=r.for_seconds, severity=r.severity, description=r.description, enabled=r.enabled),
             r.pool.name if r.pool_id else None)
            for r in AlertRule.objects.select_related("pool").order_by("name", F("pool_id").asc(nulls_first=True))
        ]
        self.stdout.write(yaml.safe_dump(prometheus_rules(pairs, window_s=window), sort_keys=False), ending="")
