"""``manage.py dashboard_cpu_alert_rules``: give CPU pools alert thresholds that fit CPU workers.

Without ``--pool``, every pool without GPUs gets the profile (``apps.dashboard.services.CPU_RULES``).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from apps.dashboard.services import CPU_RULES, pool_alert_rules_apply_cpu
from apps.fleet.models import Pool


class Command(BaseCommand):
    help = "Set CPU-appropriate alert rules (pool overrides of the GPU-fleet defaults) for CPU pools."

    def add_arguments(self, parser):
        parser.add_argument("--pool", type=int, action="append", dest="pool_ids", default=[],
                            help="Pool id (repeatable). Default: every pool with gpu_count 0.")

    def handle(self, *args, pool_ids: list[int], **options):
        pools = list(Pool.objects.filter(pk__in=pool_ids) if pool_ids else Pool.objects.filter(gpu_count=0))
        missing = sorted(set(pool_ids) - {p.pk for p in pools})
        if missing:
            raise CommandError(f"No pool with id {', '.join(map(str, missing))}.")
        for pool in pools:
            try:
                pool_alert_rules_apply_cpu(pool=pool)
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(f"pool {pool.pk} ({pool}): {len(CPU_RULES)} CPU rules applied")
        if not pools:
            self.stdout.write("no CPU pools")
