"""Writes for Actions: create (idempotent, one active per pool), retry, cancel, claim, lease, finish, log."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F, JSONField, Q, QuerySet, Value
from django.db.models.expressions import CombinedExpression
from django.utils import timezone
from kombu.exceptions import OperationalError

from apps.core.errors import ConflictError
from apps.fleet.models import Pool
from apps.operations.models import Action

logger = logging.getLogger(__name__)

EXECUTE_ACTION_TASK = "operations.execute_action"
"""Name of the Celery task that runs one Action (:func:`apps.operations.tasks.execute_action`)."""


def _log_line(message: str) -> dict[str, str]:
    return {"at": timezone.now().isoformat(), "message": message}


def action_enqueue(*, action_id: int) -> None:
    """Send ``operations.execute_action`` for ``action_id`` to the broker (call after commit).

    The task is sent by its name (:data:`EXECUTE_ACTION_TASK`), as beat and ``CELERY_TASK_ROUTES`` name
    it: ``tasks.py`` is the top of this app (its tasks import execution and reconcile, which import
    these services), so no module imports it. If the broker is unreachable the Action stays pending
    (logged); the reconcile tick enqueues it later.
    """
    Action.objects.filter(pk=action_id).update(queued_at=timezone.now())
    try:
        current_app.signature(EXECUTE_ACTION_TASK).apply_async(args=[action_id], retry=True, retry_policy={"max_retries": 1, "interval_start": 0})
    except OperationalError:
        logger.warning("broker unreachable: action %s stays pending until reconcile enqueues it", action_id)


def _busy_message(pool: Pool, busy: Action) -> str:
    return (f"Pool {pool} already has action #{busy.pk} ({busy.kind}, {busy.status}); "
            "wait for it to finish or cancel it, then retry.")


def action_create(
    *,
    kind: str,
    target_type: str,
    target_id: str,
    target_repr: str = "",
    pool: Pool | None = None,
    params: dict[str, Any] | None = None,
    requested_by: AbstractBaseUser | None = None,
    idempotency_key: str | None = None,
    retry_of: Action | None = None,
    requester: str = "",
) -> tuple[Action, bool]:
    """Create a pending Action and enqueue it after commit; return ``(action, created)``.

    With ``idempotency_key``, a second call with the same key returns the first Action and
    ``created=False``. The pool, when given, is locked: one pending/running Action per pool.
    ``requester`` names a requester that is not a user (e.g. ``rollout:7``) in the first log line.

    Raises:
        ConflictError: the pool has an active Action, or the key was used for a different request.
    """
    params = params or {}
    signature = (kind, target_type, str(target_id), params)
    with transaction.atomic():
        if idempotency_key is not None:
            existing = Action.objects.filter(idempotency_key=idempotency_key).first()
            if existing is not None:
                if (existing.kind, existing.target_type, existing.target_id, existing.params) != signature:
                    raise ConflictError(f"Idempotency-Key {idempotency_key!r} was already used for a different "
                                        f"request (action #{existing.pk}); use a new key.")
                return existing, False
        if pool is not None:
            Pool.objects.select_for_update().filter(pk=pool.pk).first()  # serialize writers of this pool
            busy = Action.objects.filter(pool=pool, status__in=Action.ACTIVE_STATUSES).first()
            if busy is not None:
                raise ConflictError(_busy_message(pool, busy))
        action = Action(
            kind=kind, target_type=target_type, target_id=str(target_id), target_repr=target_repr[:200], pool=pool,
            params=params, requested_by=requested_by, idempotency_key=idempotency_key, retry_of=retry_of,
            log=[_log_line(f"requested by {requested_by or requester or 'system'}")],
        )
        action.full_clean(validate_unique=False, validate_constraints=False)
        try:
            with transaction.atomic():
                action.save()
        except IntegrityError as exc:  # lost a race on the key or the pool lock
            if idempotency_key is not None:
                existing = Action.objects.filter(idempotency_key=idempotency_key).first()
                if existing is not None:
                    return existing, False
            raise ConflictError(f"Another action for {target_type} {target_id} was created concurrently.") from exc
        transaction.on_commit(lambda: action_enqueue(action_id=action.pk))
    return action, True


def action_record_done(*, kind: str, target_type: str, target_id: str, target_repr: str = "",
                       params: dict[str, Any] | None = None, requested_by: AbstractBaseUser | None = None,
                       message: str = "") -> Action:
    """Record a change already made in the caller's transaction (nothing to execute) as a succeeded Action,
    so the audit log lists it with who asked and when; ``message`` is its second log line. Takes no pool lock.
    """
    now = timezone.now()
    log = [_log_line(f"requested by {requested_by or 'system'}")] + ([_log_line(message)] if message else [])
    action = Action(kind=kind, target_type=target_type, target_id=str(target_id), target_repr=target_repr[:200],
                    params=params or {}, requested_by=requested_by, status=Action.Status.SUCCEEDED, started_at=now,
                    finished_at=now, log=log)
    action.full_clean(validate_unique=False, validate_constraints=False)
    action.save()
    return action


def action_requester(action: Action) -> str:
    """Who asked for ``action``, as its audit log says: the user's name, else ``params["requester"]`` (e.g.
    ``rollout:7``), else what :func:`action_create` wrote in the first log line (``requested by autoscaler``),
    else ``system``."""
    if action.requested_by_id is not None:
        return action.requested_by.get_username()
    if action.params.get("requester"):
        return str(action.params["requester"])
    first = action.log[0]["message"] if action.log else ""
    return first.removeprefix("requested by ") if first.startswith("requested by ") else "system"


def action_retry(
    *, action: Action, requested_by: AbstractBaseUser | None = None, idempotency_key: str | None = None
) -> tuple[Action, bool]:
    """A new pending Action with the same kind, target and params, ``retry_of`` the given one.

    Raises:
        ConflictError: the Action is not failed or cancelled, or its pool is busy.
    """
    if action.status not in (Action.Status.FAILED, Action.Status.CANCELLED):
        raise ConflictError(f"Only failed or cancelled actions can be retried; #{action.pk} is {action.status}.")
    return action_create(
        kind=action.kind, target_type=action.target_type, target_id=action.target_id, target_repr=action.target_repr,
        pool=action.pool, params=action.params, requested_by=requested_by, idempotency_key=idempotency_key,
        retry_of=action,
    )


def action_cancel(*, action: Action, cancelled_by: AbstractBaseUser | None = None) -> Action:
    """Cancel a pending Action (a conditional update, so a concurrent claim wins cleanly).

    Raises:
        ConflictError: the Action is no longer pending.
    """
    with transaction.atomic():
        now = timezone.now()
        updated = Action.objects.filter(pk=action.pk, status=Action.Status.PENDING).update(
            status=Action.Status.CANCELLED, finished_at=now
        )
        if updated != 1:
            action.refresh_from_db(fields=["status"])
            raise ConflictError(f"Only pending actions can be cancelled; #{action.pk} is {action.status}.")
        action_log_append(action_id=action.pk, message=f"cancelled by {cancelled_by or 'system'}")
    action.refresh_from_db()
    return action


def action_log_append(*, action_id: int, message: str) -> None:
    """Append one timestamped line to an Action's log, in one ``UPDATE`` (PostgreSQL's ``jsonb || jsonb``
    appends to the array under the row's lock, so concurrent appends all land).

    Raises:
        Action.DoesNotExist: no Action has that id.
    """
    line = Value([_log_line(message)], output_field=JSONField())
    if not Action.objects.filter(pk=action_id).update(log=CombinedExpression(F("log"), "||", line)):
        raise Action.DoesNotExist(f"action {action_id} does not exist")


def action_claim(*, action_id: int, lease_s: int | None = None, owner: str = "") -> bool:
    """Move a pending Action to running with a lease held by ``owner``; False if it was not pending.

    The conditional update is the claim: of two deliveries of the same message only one sees
    ``pending``. ``attempts`` counts claims (a takeover or a retry claims again).
    """
    now = timezone.now()
    lease = timedelta(seconds=lease_s if lease_s is not None else settings.FERRY_ACTION_LEASE_S)
    with transaction.atomic():
        return Action.objects.filter(pk=action_id, status=Action.Status.PENDING).update(
            status=Action.Status.RUNNING, started_at=now, lease_expires_at=now + lease, lease_owner=owner,
            attempts=F("attempts") + 1, error="", retryable=None,
        ) == 1


def action_lease_renew(*, action_id: int, owner: str, lease_s: int | None = None) -> bool:
    """Extend the lease of a running Action held by ``owner``; False once it lost the lease."""
    lease = timedelta(seconds=lease_s if lease_s is not None else settings.FERRY_ACTION_LEASE_S)
    return Action.objects.filter(pk=action_id, status=Action.Status.RUNNING, lease_owner=owner).update(
        lease_expires_at=timezone.now() + lease
    ) == 1


def _running(action_id: int, owner: str | None) -> QuerySet[Action]:
    qs = Action.objects.filter(pk=action_id, status=Action.Status.RUNNING)
    return qs if owner is None else qs.filter(lease_owner=owner)


def action_finish(*, action_id: int, succeeded: bool, error: str = "", retryable: bool | None = None,
                  owner: str | None = None) -> bool:
    """Move a running Action to succeeded or failed (with its reason and whether a retry may help).

    With ``owner``, only the lease holder can finish it. Returns False if it was not running (or
    someone else holds the lease).
    """
    status = Action.Status.SUCCEEDED if succeeded else Action.Status.FAILED
    with transaction.atomic():
        done = _running(action_id, owner).update(
            status=status, finished_at=timezone.now(), lease_expires_at=None, error=error,
            retryable=None if succeeded else bool(retryable),
        ) == 1
        if done:
            suffix = "" if succeeded else f" ({'retryable' if retryable else 'not retryable'})"
            action_log_append(action_id=action_id, message=(status if not error else f"{status}: {error}") + suffix)
    return done


def action_release(*, action_id: int, owner: str, reason: str, retry_in_s: float = 0.0) -> bool:
    """Give a running Action back to pending (a retryable failure about to be retried by Celery).

    ``queued_at`` is set to when the retry is due, so reconcile's re-enqueue of stale pending
    Actions does not pre-empt the backoff.
    """
    with transaction.atomic():
        done = _running(action_id, owner).update(
            status=Action.Status.PENDING, lease_expires_at=None, lease_owner="",
            queued_at=timezone.now() + timedelta(seconds=retry_in_s),
        ) == 1
        if done:
            action_log_append(action_id=action_id, message=reason)
    return done


def action_leases_take_over(*, now: datetime | None = None) -> list[int]:
    """Running Actions whose lease expired (their worker died): back to pending, logged; returns ids.

    Each row moves with a conditional update on the expired lease and its owner, so two reconcile
    ticks cannot both take one over, and a worker that renews in between keeps it. The caller
    enqueues the returned ids; the handler runs again and converges (handlers are idempotent).
    """
    now = now or timezone.now()
    taken: list[int] = []
    expired = Action.objects.filter(status=Action.Status.RUNNING, lease_expires_at__lt=now)
    for action_id, owner, expires in expired.values_list("pk", "lease_owner", "lease_expires_at"):
        with transaction.atomic():
            moved = Action.objects.filter(pk=action_id, status=Action.Status.RUNNING, lease_owner=owner,
                                          lease_expires_at=expires).update(
                status=Action.Status.PENDING, lease_expires_at=None, lease_owner="", queued_at=now,
            ) == 1
            if moved:
                action_log_append(action_id=action_id, message=f"lease of {owner or 'unknown'} expired at "
                                  f"{expires.isoformat()}; taken over by reconcile")
        if moved:
            taken.append(action_id)
    return taken


def action_pending_stale(*, older_than_s: float, now: datetime | None = None) -> list[int]:
    """Pending Actions last queued more than ``older_than_s`` ago (lost message, broker outage)."""
    cutoff = (now or timezone.now()) - timedelta(seconds=older_than_s)
    stale = Action.objects.filter(status=Action.Status.PENDING).filter(
        Q(queued_at__lt=cutoff) | Q(queued_at__isnull=True, created_at__lt=cutoff))
    return list(stale.values_list("pk", flat=True))
