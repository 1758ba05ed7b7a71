"""Writes for telemetry: default alert rules, alert state changes, webhook notification."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime

import httpx
from django.conf import settings
from django.db import transaction

from apps.telemetry.alerts import DEFAULT_RULES, AlertTransition
from apps.telemetry.broadcast import FLEET_GROUP, pool_group, telemetry_broadcast
from apps.telemetry.history import SignalHistory
from apps.telemetry.models import Alert, AlertRule

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


def alert_payload(alert: Alert) -> dict:
    """The JSON form of an alert used by the channel layer, the webhook and the API."""
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
    }


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
                alert, _ = Alert.objects.select_related("rule").get_or_create(
                    rule_id=rule_id, pool_id=pool_id, state=Alert.State.FIRING,
                    defaults={"started_at": _dt(t.started_at_s), "value": t.value,
                              "severity": AlertRule.objects.values_list("severity", flat=True).get(pk=rule_id)},
                )
                changed.append(alert)
            elif t.kind == "resolved":
                alert = (Alert.objects.select_related("rule").select_for_update()
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
        if url or default_url:
            alert_notify(url=url or default_url, payload=payload)
