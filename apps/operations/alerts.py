"""Operator verbs on alerts: acknowledge, silence for a period, end a silence; each recorded in the audit log.

Each verb changes telemetry's rows (:mod:`apps.telemetry.services`) and records a succeeded Action
(``alert.acknowledge``, ``alert.silence``, ``alert.unsilence``; target ``alert:<id>``, requested by the user) in
one transaction, then broadcasts the alert's new state to its pool's and the fleet's streams after commit, so
every open page shows it acknowledged or silenced at once. A silenced alert keeps firing and resolving on the
pages; only its webhook stays quiet (:func:`apps.telemetry.services.alert_transitions_apply`).
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from apps.operations.models import Action
from apps.operations.services import action_record_done
from apps.telemetry import services as telemetry
from apps.telemetry.broadcast import FLEET_GROUP, pool_group, telemetry_broadcast
from apps.telemetry.history import SignalHistory
from apps.telemetry.models import Alert
from apps.telemetry.selectors import alert_list

ALERT_ACKNOWLEDGE = "alert.acknowledge"
ALERT_SILENCE = "alert.silence"
ALERT_UNSILENCE = "alert.unsilence"


def _target(alert: Alert) -> dict:
    return {"target_type": "alert", "target_id": str(alert.pk),
            "target_repr": f"{alert.rule.name} on pool {alert.pool}"}


def _broadcast_after_commit(alert_id: int) -> None:
    def send() -> None:
        alert = alert_list().get(pk=alert_id)
        payload = telemetry.alert_payload(alert, silenced_until=alert.silenced_until)
        history = SignalHistory()
        for group in (pool_group(alert.pool_id), FLEET_GROUP):
            telemetry_broadcast(group, "telemetry.alert", {"alert": payload}, history=history)

    transaction.on_commit(send)


def alert_acknowledge(*, alert: Alert, user: AbstractBaseUser) -> tuple[Alert, Action | None]:
    """Acknowledge a firing alert as ``user``; returns ``(alert, audit Action)``, the Action ``None`` when it was
    already acknowledged (nothing changed, nothing recorded).

    Raises:
        ConflictError: the alert has resolved.
    """
    with transaction.atomic():
        if not telemetry.alert_acknowledge(alert=alert, user=user):
            return alert, None
        action = action_record_done(kind=ALERT_ACKNOWLEDGE, requested_by=user,
                                    params={"rule": alert.rule.name, "pool_id": alert.pool_id, "value": alert.value},
                                    message=f"acknowledged {alert.rule.name} (firing since "
                                            f"{alert.started_at.isoformat()})", **_target(alert))
        _broadcast_after_commit(alert.pk)
    return alert, action


def alert_silence(*, alert: Alert, duration_s: int, user: AbstractBaseUser, comment: str = "") -> Action:
    """Silence ``alert``'s rule on its pool for ``duration_s`` seconds as ``user``; returns the audit Action.

    Raises:
        ValidationError: ``duration_s`` out of bounds (``apps.telemetry.services.MIN_SILENCE_S`` ..
            ``MAX_SILENCE_S``) or ``comment`` over 300 characters.
    """
    with transaction.atomic():
        silence = telemetry.alert_silence_create(alert=alert, duration_s=duration_s, user=user, comment=comment)
        action = action_record_done(
            kind=ALERT_SILENCE, requested_by=user,
            params={"rule": alert.rule.name, "pool_id": alert.pool_id, "duration_s": duration_s,
                    "until": silence.ends_at.isoformat(), "silence_id": silence.pk, "comment": comment},
            message=f"silenced {alert.rule.name} on this pool until {silence.ends_at.isoformat()}"
                    + (f": {comment}" if comment else ""), **_target(alert))
        _broadcast_after_commit(alert.pk)
    return action


def alert_unsilence(*, alert: Alert, user: AbstractBaseUser) -> Action | None:
    """End now the silences of ``alert``'s rule on its pool; returns the audit Action, ``None`` when none was in
    effect (nothing recorded)."""
    with transaction.atomic():
        ended = telemetry.alert_silence_end(alert=alert)
        if not ended:
            return None
        action = action_record_done(kind=ALERT_UNSILENCE, requested_by=user,
                                    params={"rule": alert.rule.name, "pool_id": alert.pool_id, "ended": ended},
                                    message=f"ended {ended} silence(s) of {alert.rule.name}", **_target(alert))
        _broadcast_after_commit(alert.pk)
    return action
