"""Writes for telemetry: default alert rules, alert state changes, acknowledgements and silences, webhook
notification (never for a silenced alert).

Acknowledge and silence here change telemetry's rows only; the operator verbs that also record them in the
audit log are :mod:`apps.operations.alerts` (the API and pages call those)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime

import httpx
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Max

from apps.core.errors import ConflictError
from apps.telemetry.alerts import DEFAULT_RULES, AlertTransition
from apps.telemetry.broadcast import FLEET_GROUP, pool_group, telemetry_broadcast
from apps.telemetry.history import SignalHistory
from apps.telemetry.models import Alert, AlertRule, AlertSilence

logger = logging.getLogger(__name__)


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


@transaction.atomic
def alert_rules_load_defaults() -> int:
    """Create the fleet-default rules that are missing (existing ones keep their edits); returns how many."""
    created = 0
    for rule in DEFAULT_RULES:
        _, was_created = AlertRule.objects.get_or_create(
            name=rule["name"], pool=None, defaults={k: v for k, v in rule.items() if k != "name"}
        )
        created += was_created
    return created


@transaction.atomic
def alert_rule_create(**fields) -> AlertRule:
    """Create an alert rule (validated with ``full_clean``; ``ValidationError`` names the bad field)."""
    rule = AlertRule(**fields)
    rule.full_clean()
    rule.save()
    return rule


@transaction.atomic
def alert_rule_update(*, rule: AlertRule, **changes) -> AlertRule:
    """Change a rule's fields (threshold, for_seconds, ...); the poller reads it on its next tick."""
    for name, value in changes.items():
        setattr(rule, name, value)
    rule.full_clean()
    rule.save()
    return rule


@transaction.atomic
def alert_rule_delete(*, rule: AlertRule) -> None:
    """Delete a rule and its alert history (a firing alert ends with it)."""
    rule.delete()


def alerts_prune(*, older_than_s: float) -> int:
    """Delete resolved alerts that ended more than ``older_than_s`` seconds ago; returns how many."""
    if older_than_s <= 0:
        raise ValueError(f"older_than_s must be positive, got {older_than_s}")
    cutoff = _dt(datetime.now(tz=UTC).timestamp() - older_than_s)
    deleted, _ = Alert.objects.filter(state=Alert.State.RESOLVED, ended_at__lt=cutoff).delete()
    return deleted


MIN_SILENCE_S = 60
MAX_SILENCE_S = 7 * 24 * 3600
"""Bounds of a silence's duration, seconds (one minute .. one week)."""


def alert_silenced_until(*, rule_id: int, pool_id: int, now: datetime | None = None) -> datetime | None:
    """The end of the latest silence of ``rule_id`` on ``pool_id`` in effect at ``now``; ``None``: not silenced."""
    now = now or datetime.now(tz=UTC)
    return (AlertSilence.objects.filter(rule_id=rule_id, pool_id=pool_id, starts_at__lte=now, ends_at__gt=now)
            .aggregate(until=Max("ends_at"))["until"])


def alert_payload(alert: Alert, *, silenced_until: datetime | None | bool = False) -> dict:
    """The JSON form of an alert used by the channel layer, the webhook and the API.

    ``silenced_until``: the end of the silence in effect (``None``: not silenced), when the caller read it
    for many alerts at once; left out (``False``), it is read here (one query). ``acknowledged_by`` is the
    user's name (``alert.acknowledged_by`` is read: select it with the alert).
    """
    if silenced_until is False:
        silenced_until = alert_silenced_until(rule_id=alert.rule_id, pool_id=alert.pool_id)
    return {
        "id": alert.pk,
        "rule": alert.rule.name,
        "signal": alert.rule.signal,
        "comparison": alert.rule.comparison,
        "threshold": alert.rule.threshold,
        "severity": alert.severity,
        "pool_id": alert.pool_id,
        "state": alert.state,
        "started_at": alert.started_at.isoformat(),
        "ended_at": alert.ended_at.isoformat() if alert.ended_at else None,
        "value": alert.value,
        "acknowledged_at": alert.acknowledged_at.isoformat() if alert.acknowledged_at else None,
        "acknowledged_by": alert.acknowledged_by.get_username() if alert.acknowledged_by_id else None,
        "silenced_until": silenced_until.isoformat() if silenced_until else None,
    }


@transaction.atomic
def alert_acknowledge(*, alert: Alert, user: AbstractBaseUser) -> bool:
    """Mark a firing ``alert`` acknowledged by ``user`` now; returns False if it already was (unchanged).

    Raises:
        ConflictError: the alert has resolved (nothing left to acknowledge).
    """
    locked = Alert.objects.select_for_update().get(pk=alert.pk)
    if locked.state != Alert.State.FIRING:
        raise ConflictError(f"Alert {alert.pk} ({alert.rule.name}) resolved at {locked.ended_at.isoformat()}; "
                            "only firing alerts can be acknowledged.")
    if locked.acknowledged_at is not None:
        alert.acknowledged_at, alert.acknowledged_by = locked.acknowledged_at, locked.acknowledged_by
        return False
    alert.acknowledged_at, alert.acknowledged_by = datetime.now(tz=UTC), user
    alert.save(update_fields=["acknowledged_at", "acknowledged_by"])
    return True


@transaction.atomic
def alert_silence_create(*, alert: Alert, duration_s: int, user: AbstractBaseUser, comment: str = "") -> AlertSilence:
    """Silence ``alert``'s rule on its pool for ``duration_s`` seconds from now (firing or resolved: a resolved
    alert's rule may fire again). Overlapping silences are allowed; the latest end wins.

    Raises:
        ValidationError: ``duration_s`` outside ``MIN_SILENCE_S`` .. ``MAX_SILENCE_S``.
    """
    if not MIN_SILENCE_S <= duration_s <= MAX_SILENCE_S:
        raise ValidationError({"duration_s": f"Silence for {MIN_SILENCE_S} s to {MAX_SILENCE_S} s (one week); "
                                             f"got {duration_s} s."})
    now = datetime.now(tz=UTC)
    silence = AlertSilence(rule_id=alert.rule_id, pool_id=alert.pool_id, starts_at=now,
                           ends_at=_dt(now.timestamp() + duration_s), created_by=user, comment=comment)
    silence.full_clean()
    silence.save()
    return silence


@transaction.atomic
def alert_silence_end(*, alert: Alert) -> int:
    """End now every silence of ``alert``'s rule on its pool that is in effect; returns how many ended."""
    now = datetime.now(tz=UTC)
    return AlertSilence.objects.filter(rule_id=alert.rule_id, pool_id=alert.pool_id, starts_at__lte=now,
                                       ends_at__gt=now).update(ends_at=now)


def alert_notify(*, url: str, payload: dict, timeout_s: float = 5.0) -> bool:
    """POST ``payload`` as JSON to ``url``; failures are logged, never raised. Returns success."""
    try:
        response = httpx.post(url, json=payload, timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("alert webhook %s failed for alert %s: %s", url, payload.get("id"), exc)
        return False
    return True


def alert_transitions_apply(
    *, pool_id: int, transitions: Iterable[AlertTransition], history: SignalHistory
) -> list[Alert]:
    """Record fired/resolved transitions of one pool in one transaction; after commit, broadcast
    each alert to the pool and fleet groups and POST it to its rule's webhook (or
    ``settings.FERRY_ALERT_WEBHOOK_URL``). Returns the alerts written."""
    changed: list[Alert] = []
    with transaction.atomic():
        for t in transitions:
            rule_id = int(t.rule_key)
            if t.kind == "fired":
                alert, _ = Alert.objects.select_related("rule", "acknowledged_by").get_or_create(
                    rule_id=rule_id, pool_id=pool_id, state=Alert.State.FIRING,
                    defaults={"started_at": _dt(t.started_at_s), "value": t.value,
                              "severity": AlertRule.objects.values_list("severity", flat=True).get(pk=rule_id)},
                )
                changed.append(alert)
            elif t.kind == "resolved":
                alert = (Alert.objects.select_related("rule", "acknowledged_by").select_for_update(of=("self",))
                         .filter(rule_id=rule_id, pool_id=pool_id, state=Alert.State.FIRING).first())
                if alert is None:
                    continue
                alert.state, alert.ended_at = Alert.State.RESOLVED, _dt(t.ended_at_s)
                alert.save(update_fields=["state", "ended_at"])
                changed.append(alert)
            else:
                raise ValueError(f"unknown alert transition {t.kind!r}")
        payloads = [(alert_payload(a), a.rule.webhook_url) for a in changed]
        transaction.on_commit(lambda: _after_commit(pool_id, payloads, history))
    return changed


def _after_commit(pool_id: int, payloads: list[tuple[dict, str]], history: SignalHistory) -> None:
    default_url = getattr(settings, "FERRY_ALERT_WEBHOOK_URL", "")
    for payload, url in payloads:
        for group in (pool_group(pool_id), FLEET_GROUP):
            telemetry_broadcast(group, "telemetry.alert", {"alert": payload}, history=history)
        if payload["silenced_until"]:
            logger.info("alert %s (%s) is silenced until %s: no notification", payload["id"], payload["rule"],
                        payload["silenced_until"])
        elif url or default_url:
            alert_notify(url=url or default_url, payload=payload)
