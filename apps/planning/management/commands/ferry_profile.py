"""``manage.py ferry_profile POOL``: profile a pool on its real workers, or import a profile file for it.

Without ``--import`` it requests a ``pool.profile`` Action (the page's path) and runs it here, in this process,
as the Celery task would (if a Celery worker claims it first, the command waits for that run): the sweep of
:mod:`apps.planning.profiling`, a least-squares fit, a stored ``measured`` profile. A failure is recorded on the
Action with the reason (retry it from the audit log) and the command exits with an error.

With ``--import FILE`` it stores the file's points (:func:`apps.planning.services.profile_import`) for the pool's
model version and role; a malformed file is an error naming what is wrong.
"""

from __future__ import annotations

import time
from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from apps.core.errors import ConflictError
from apps.fleet.models import Pool
from apps.operations.execution import RetryLater, action_execute
from apps.operations.models import Action
from apps.planning import profiling, services

WAIT_FOR_OTHER_RUN_S = 600.0


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise CommandError(f"expected comma-separated whole numbers, got {text!r}") from exc


class Command(BaseCommand):
    help = "Profile a pool (prefill time vs prompt length, decode step vs batch) or import a profile file."

    def add_arguments(self, parser) -> None:  # noqa: ANN001 - Django signature
        parser.add_argument("pool", help="Pool id, or name (unique across clusters), or cluster/name.")
        parser.add_argument("--import", dest="import_file", help="Import this JSON profile file instead of measuring.")
        parser.add_argument("--hardware-label", default="", help="What the pool runs on, e.g. cpu-2core (measuring).")
        parser.add_argument("--lengths", default=",".join(map(str, profiling.DEFAULT_LENGTHS)),
                            help="Prompt lengths (tokens), comma-separated, 3 to 8.")
        parser.add_argument("--batch-sizes", default=",".join(map(str, profiling.DEFAULT_BATCH_SIZES)),
                            help="Decode batch sizes, comma-separated, 2 to 6.")
        parser.add_argument("--max-new-tokens", type=int, default=profiling.DEFAULT_MAX_NEW_TOKENS,
                            help="Tokens each decode stream generates (4..64).")

    def _pool(self, ref: str) -> Pool:
        pools = Pool.objects.select_related("cluster", "model_version")
        if ref.isdigit():
            found = list(pools.filter(pk=int(ref)))
        elif "/" in ref:
            cluster, _, name = ref.partition("/")
            found = list(pools.filter(cluster__name=cluster, name=name))
        else:
            found = list(pools.filter(name=ref))
        if len(found) != 1:
            raise CommandError(f"pool {ref!r}: {'no such pool' if not found else 'ambiguous: use cluster/name'}")
        return found[0]

    def handle(self, *args, **options) -> None:
        pool = self._pool(options["pool"])
        if options["import_file"]:
            path = Path(options["import_file"])
            try:
                text = path.read_text()
            except OSError as exc:
                raise CommandError(f"cannot read {path}: {exc}") from exc
            try:
                profile = services.profile_import(pool=pool, text=text)
            except ValidationError as exc:
                raise CommandError(f"{path}: {'; '.join(f'{k}: {v}' for k, v in exc.message_dict.items())}") from exc
            self.stdout.write(f"imported profile #{profile.pk}: {profile}")
            return
        try:
            action, _ = services.profile_measure(
                pool=pool, hardware_label=options["hardware_label"] or "unlabelled",
                lengths=_ints(options["lengths"]), batch_sizes=_ints(options["batch_sizes"]),
                max_new_tokens=options["max_new_tokens"], requester="ferry_profile")
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from exc
        except ConflictError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"action #{action.pk} {action.kind} on pool {pool}")
        try:
            outcome = action_execute(action_id=action.pk, max_retries=0)
        except RetryLater as exc:
            raise CommandError(f"action #{action.pk}: {exc.reason}") from exc
        if outcome == "skipped":  # a Celery worker claimed it first: wait for its run
            deadline = time.monotonic() + WAIT_FOR_OTHER_RUN_S
            while Action.objects.filter(pk=action.pk, status__in=Action.ACTIVE_STATUSES).exists():
                if time.monotonic() > deadline:
                    raise CommandError(f"action #{action.pk} is still running elsewhere; see the audit log")
                time.sleep(1)
        action.refresh_from_db()
        for line in action.log:
            self.stdout.write(f"  {line['message']}")
        if action.status != Action.Status.SUCCEEDED:
            raise CommandError(f"action #{action.pk} {action.status}: {action.error}"
                               + (" (retryable)" if action.retryable else ""))
