"""Running one Action: claim, lease heartbeat, handler, and the outcome by exception type.

:func:`action_execute` is what the Celery task ``operations.execute_action`` calls. Policy:

* the claim is a conditional update (pending -> running) with a random lease owner, so a duplicate
  delivery returns ``"skipped"`` without touching anything;
* while the handler runs, a heartbeat thread renews the lease every ``lease_s / 3`` seconds (long
  backend waits included); if the worker process dies, the lease expires and reconcile takes over;
* ``BackendUnavailable`` (and other ``BackendError`` with ``retryable``) -> :class:`RetryLater`: the
  Action goes back to pending and the task retries with exponential backoff; once retries are
  exhausted it fails with ``retryable=True``;
* ``ActionError``, ``InvalidSpec``, ``NotFound``, ``Conflict`` -> failed, not retryable (an
  ``ActionError`` may say ``retryable=True``, e.g. a readiness timeout: recorded, not auto-retried);
* Celery's soft time limit -> failed, retryable; any other exception -> failed (recorded) and re-raised.
"""

from __future__ import annotations

import logging
import threading
import uuid

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import close_old_connections, connection

from apps.operations import services
from apps.operations.handlers import HANDLERS, ActionError
from apps.operations.models import Action
from apps.orchestrators.base import BackendError

logger = logging.getLogger(__name__)


class RetryLater(Exception):
    """A retryable failure: the caller should retry the task after ``countdown_s`` seconds."""

    def __init__(self, reason: str, countdown_s: float) -> None:
        super().__init__(reason)
        self.reason, self.countdown_s = reason, countdown_s


def retry_countdown_s(retries: int, *, base_s: float = 2.0, max_s: float = 60.0) -> float:
    """Exponential backoff before retry number ``retries + 1``: ``min(base * 2**retries, max)`` seconds."""
    return min(base_s * (2**retries), max_s)


class LeaseHeartbeat(threading.Thread):
    """Renews the lease of a running Action until stopped; ``lost`` is set if the lease was taken."""

    def __init__(self, action_id: int, owner: str, lease_s: int) -> None:
        super().__init__(name=f"lease-{action_id}", daemon=True)
        self.action_id, self.owner, self.lease_s = action_id, owner, lease_s
        self.interval_s = max(lease_s / 3, 0.2)
        self._stop_event = threading.Event()
        self.lost = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval_s):
                try:
                    renewed = services.action_lease_renew(action_id=self.action_id, owner=self.owner,
                                                          lease_s=self.lease_s)
                except Exception:  # a database blip: try again next beat, the lease has slack
                    logger.exception("renewing the lease of action %s failed", self.action_id)
                    close_old_connections()
                    continue
                if not renewed:
                    self.lost.set()
                    return
        finally:
            connection.close()  # this thread's own connection

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


def action_execute(*, action_id: int, retries: int = 0, max_retries: int = 5, lease_s: int | None = None) -> str:
    """Claim and run Action ``action_id``.

    Returns:
        ``"skipped"`` (not pending: a duplicate delivery or a cancelled Action), ``"succeeded"``,
        ``"failed"``, or ``"lost-lease"`` (it ran, but another executor took the lease meanwhile).

    Raises:
        RetryLater: a retryable backend failure with retries left; the Action is pending again.
        Exception: an unexpected handler exception, after the Action is recorded as failed.
    """
    lease_s = lease_s if lease_s is not None else settings.FERRY_ACTION_LEASE_S
    owner = uuid.uuid4().hex
    if not services.action_claim(action_id=action_id, lease_s=lease_s, owner=owner):
        return "skipped"
    action = Action.objects.select_related("pool", "pool__cluster").get(pk=action_id)
    handler = HANDLERS.get(action.kind)
    if handler is None:
        services.action_finish(action_id=action_id, succeeded=False, owner=owner,
                               error=f"no handler is registered for action kind {action.kind!r}")
        return "failed"
    services.action_log_append(action_id=action_id, message=f"attempt {action.attempts} started")
    heartbeat = LeaseHeartbeat(action_id, owner, lease_s)
    heartbeat.start()
    try:
        handler(action)
    except (ActionError, BackendError) as exc:
        heartbeat.stop()
        retryable = bool(getattr(exc, "retryable", False))
        reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, BackendError) else str(exc)
        if isinstance(exc, BackendError) and retryable and retries < max_retries:
            countdown = retry_countdown_s(retries)
            services.action_release(action_id=action_id, owner=owner, retry_in_s=countdown,
                                    reason=f"{reason}; retry {retries + 1}/{max_retries} in {countdown:.0f}s")
            raise RetryLater(reason, countdown) from exc
        services.action_finish(action_id=action_id, succeeded=False, error=reason, retryable=retryable, owner=owner)
        return "failed"
    except SoftTimeLimitExceeded:
        heartbeat.stop()
        services.action_finish(action_id=action_id, succeeded=False, retryable=True, owner=owner,
                               error="the task's soft time limit was exceeded before the action finished")
        return "failed"
    except Exception as exc:
        heartbeat.stop()
        services.action_finish(action_id=action_id, succeeded=False, error=f"{type(exc).__name__}: {exc}",
                               retryable=False, owner=owner)
        raise
    heartbeat.stop()
    if not services.action_finish(action_id=action_id, succeeded=True, owner=owner):
        return "lost-lease"
    return "succeeded"
