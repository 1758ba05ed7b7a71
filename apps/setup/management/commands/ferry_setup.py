"""``manage.py ferry_setup``: everything ``make run`` does to the database before starting processes.

In order, each step idempotent: ``migrate``; the ``admin`` and ``operator`` users (password and API
token printed when created, the token again on later runs); the periodic tasks (``ferry_beat_setup``
plus the periodic tasks other apps define but no setup command registers yet, see
``EXTRA_PERIODIC_TASKS``); the demo fleet (``--agent-url``; skip with ``--no-demo``); with
``--client-key-sha256``, the client API key ``make-run`` (:data:`MAKE_RUN_CLIENT_KEY`) with that hash: the
launcher keeps the key itself and prints it, the control plane stores only its SHA-256 and delivers it to the
routers in the routing table (a new hash replaces the old one; an Action records each change).

``--json`` adds a last line ``FERRY_SETUP_JSON {...}`` (users, demo pools) for the launcher.
"""

from __future__ import annotations

import json

from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from apps.accounts.roles import ADMIN, OPERATOR
from apps.accounts.selectors import user_exists
from apps.accounts.services import user_create_with_role
from apps.operations.client_keys import client_key_import
from apps.operations.management.commands.ferry_beat_setup import beat_setup
from apps.setup.demo import demo_fleet_load

# task name -> (periodic task name, seconds, queue); created only when no periodic task runs that task.
EXTRA_PERIODIC_TASKS = {
    "rollouts.tick": ("ferry: rollouts tick", 2, "default"),
    "telemetry.prune_alerts": ("ferry: prune resolved alerts", 3600, "default"),
}
JSON_PREFIX = "FERRY_SETUP_JSON "
MAKE_RUN_CLIENT_KEY = "make-run"


def extra_periodic_tasks_ensure() -> list[PeriodicTask]:
    """Create the ``EXTRA_PERIODIC_TASKS`` that no periodic task covers yet; returns the ones created."""
    created = []
    with transaction.atomic():
        for task, (name, seconds, queue) in EXTRA_PERIODIC_TASKS.items():
            if PeriodicTask.objects.filter(task=task).exists():
                continue
            every, _ = IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)
            created.append(PeriodicTask.objects.create(
                name=name, task=task, interval=every, queue=queue, expire_seconds=seconds,
                description=f"Ferry {task} every {seconds}s (created by ferry_setup)"))
    return created


def user_ensure(username: str, role: str) -> dict[str, str | None]:
    """Create ``username`` with ``role`` unless it exists; returns username, role, password and token (both for
    a new user only: tokens are stored hashed and cannot be shown again)."""
    if user_exists(username=username):
        return {"username": username, "role": role, "password": None, "token": None}
    created = user_create_with_role(username=username, role=role)
    return {"username": username, "role": role, "password": created.password, "token": created.token}


class Command(BaseCommand):
    help = "Migrate, create the admin/operator users, register periodic tasks and load the demo fleet (idempotent)."

    def add_arguments(self, parser) -> None:  # noqa: ANN001 - Django signature
        parser.add_argument("--agent-url", default="http://127.0.0.1:8100", help="local agent of the demo clusters")
        parser.add_argument("--router-url", default=None,
                            help="base URL of the router in front of the demo pools (registered as demo-router)")
        parser.add_argument("--replicas", type=int, default=1, help="replicas of each new demo pool")
        parser.add_argument("--no-demo", action="store_true", help="skip the demo fleet")
        parser.add_argument("--client-key-sha256", default=None, metavar="HEX",
                            help=f"SHA-256 of the launcher's client API key, stored as key {MAKE_RUN_CLIENT_KEY!r}")
        parser.add_argument("--json", action="store_true", dest="emit_json", help=f"print a last line '{JSON_PREFIX}{{...}}'")

    def handle(self, *args, agent_url: str, router_url: str | None, replicas: int, no_demo: bool, emit_json: bool,
               client_key_sha256: str | None = None, **options) -> None:
        call_command("migrate", interactive=False, verbosity=0)
        self.stdout.write("database migrated")
        try:
            users = [user_ensure("admin", ADMIN), user_ensure("operator", OPERATOR)]
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from exc
        for user in users:
            if user["password"]:
                self.stdout.write(f"user {user['username']} ({user['role']}) created: password {user['password']}  "
                                  f"API token {user['token']}")
            else:
                self.stdout.write(f"user {user['username']} exists (password and API token unchanged; new token: "
                                  f"manage.py ferry_user --rotate-token {user['username']})")
        for task in [*beat_setup(), *extra_periodic_tasks_ensure()]:
            self.stdout.write(f"periodic task {task.name}: {task.task} every {task.interval.every}s")
        if client_key_sha256 is not None:
            try:
                _key, changed = client_key_import(name=MAKE_RUN_CLIENT_KEY, key_sha256=client_key_sha256,
                                                  requester="ferry_setup")
            except ValidationError as exc:
                raise CommandError(f"--client-key-sha256: {'; '.join(exc.messages)}") from exc
            self.stdout.write(f"client API key {MAKE_RUN_CLIENT_KEY}: " + ("stored (hash only)" if changed
                                                                          else "unchanged"))
        pools = {}
        if not no_demo:
            try:
                fleet = demo_fleet_load(agent_url=agent_url, replicas=replicas, router_url=router_url)
            except (ValidationError, FileNotFoundError) as exc:
                raise CommandError(f"demo fleet: {exc}") from exc
            for line in fleet.created:
                self.stdout.write(f"demo: created {line}")
            pools = {name: {"id": pool.pk, "role": pool.role, "replicas": pool.replicas}
                     for name, pool in fleet.pools.items()}
        if emit_json:
            self.stdout.write(JSON_PREFIX + json.dumps({"users": users, "pools": pools}, sort_keys=True))
