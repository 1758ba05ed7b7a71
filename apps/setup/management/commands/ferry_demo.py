"""``manage.py ferry_demo --agent-url http://127.0.0.1:8100``: load the demo fleet (idempotent).

Two local "datacenters" ``dc-prefill`` and ``dc-decode`` linked at 10 Gbit/s, model ``gemma-3-270m``
v1 (float32) and v2 (bfloat16), a prefill and a decode pool with the CPU alert profile; see
:mod:`apps.setup.demo`.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from apps.setup.demo import demo_fleet_load


class Command(BaseCommand):
    help = "Create the demo fleet (two local datacenters, gemma-3-270m v1/v2, prefill and decode pools) if missing."

    def add_arguments(self, parser) -> None:  # noqa: ANN001 - Django signature
        parser.add_argument("--agent-url", required=True, help="URL of the local agent, e.g. http://127.0.0.1:8100")
        parser.add_argument("--replicas", type=int, default=1, help="replicas of each new pool (0: no model workers)")

    def handle(self, *args, agent_url: str, replicas: int, **options) -> None:
        if replicas < 0:
            raise CommandError(f"--replicas must be >= 0, got {replicas}")
        try:
            fleet = demo_fleet_load(agent_url=agent_url, replicas=replicas)
        except (ValidationError, FileNotFoundError) as exc:
            raise CommandError(f"demo fleet: {exc}") from exc
        for line in fleet.created:
            self.stdout.write(f"created {line}")
        for version in fleet.model_versions.values():
            self.stdout.write(f"model {version}: sha256 {version.sha256[:16]}... dtype {version.dtype}")
        for pool in fleet.pools.values():
            self.stdout.write(f"pool {pool.pk} {pool}: role {pool.role}, {pool.replicas} replica(s)")
