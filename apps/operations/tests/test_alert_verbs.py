"""Operator verbs on alerts over the API: acknowledge, silence, unsilence — roles, audit log, notifications."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from apps.operations.models import Action
from apps.telemetry.alerts import AlertEvaluator, RuleSpec
from apps.telemetry.models import Alert, AlertRule, AlertSilence
from apps.telemetry.services import alert_transitions_apply

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def firing(pool):
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    return Alert.objects.create(rule=rule, pool=pool, severity="critical", started_at=T0, value=0.97)


def _audit(alert: Alert) -> list[tuple]:
    return list(Action.objects.filter(target_type="alert", target_id=str(alert.pk)).order_by("pk").values_list(
        "kind", "status", "requested_by__username", "params"))


def test_viewer_may_read_alerts_but_not_acknowledge_or_silence_them(viewer_api, firing):
    assert viewer_api.get(f"/api/v1/alerts/{firing.pk}/").json()["silenced_until"] is None
    for verb, body in (("acknowledge", None), ("silence", {"duration_s": 600}), ("unsilence", None)):
        r = viewer_api.post(f"/api/v1/alerts/{firing.pk}/{verb}/", body, format="json")
        assert (r.status_code, r.json()["detail"]) == (403, "This request needs the operator role; you have viewer.")
    firing.refresh_from_db()
    assert (firing.acknowledged_at, AlertSilence.objects.count(), _audit(firing)) == (None, 0, [])


def test_acknowledge_records_who_and_when_in_the_alert_and_the_audit_log_once(operator_api, firing):
    r = operator_api.post(f"/api/v1/alerts/{firing.pk}/acknowledge/")
    assert r.status_code == 200
    body = r.json()
    assert (body["acknowledged_by"], body["state"], body["silenced_until"]) == ("otto", "firing", None)
    firing.refresh_from_db()
    assert firing.acknowledged_by.username == "otto"
    assert abs(firing.acknowledged_at - datetime.now(tz=UTC)) < timedelta(seconds=30)
    assert body["acknowledged_at"] == firing.acknowledged_at.isoformat().replace("+00:00", "Z")
    # Again: unchanged, nothing more in the audit log.
    assert operator_api.post(f"/api/v1/alerts/{firing.pk}/acknowledge/").json()["acknowledged_at"] == \
        body["acknowledged_at"]
    assert _audit(firing) == [("alert.acknowledge", "succeeded", "otto",
                               {"rule": "kv-cache-usage-critical", "pool_id": firing.pool_id, "value": 0.97})]
    action = Action.objects.get(kind="alert.acknowledge")
    assert (action.target_repr, action.pool_id) == (f"kv-cache-usage-critical on pool {firing.pool}", None)


def test_a_resolved_alert_cannot_be_acknowledged(operator_api, firing):
    Alert.objects.filter(pk=firing.pk).update(state="resolved", ended_at=T0 + timedelta(minutes=5))
    r = operator_api.post(f"/api/v1/alerts/{firing.pk}/acknowledge/")
    assert (r.status_code, r.json()["detail"]) == (
        409, f"Alert {firing.pk} (kv-cache-usage-critical) resolved at 2026-12-01T12:05:00+00:00; only firing "
             "alerts can be acknowledged.")
    assert _audit(firing) == []


@pytest.mark.parametrize("body, error", [
    ({}, {"duration_s": ["This field is required."]}),
    ({"duration_s": 59}, {"duration_s": ["Ensure this value is greater than or equal to 60."]}),
    ({"duration_s": 604801}, {"duration_s": ["Ensure this value is less than or equal to 604800."]}),
    ({"duration_s": "soon"}, {"duration_s": ["A valid integer is required."]}),
])
def test_silence_refuses_a_bad_duration_with_400_and_writes_nothing(operator_api, firing, body, error):
    r = operator_api.post(f"/api/v1/alerts/{firing.pk}/silence/", body, format="json")
    assert (r.status_code, r.json()) == (400, error)
    assert (AlertSilence.objects.count(), _audit(firing)) == (0, [])


def test_silence_then_unsilence_are_audited_and_show_on_the_alert(operator_api, firing):
    before = datetime.now(tz=UTC)
    r = operator_api.post(f"/api/v1/alerts/{firing.pk}/silence/", {"duration_s": 3600, "comment": "known, fixing"},
                          format="json")
    assert r.status_code == 200
    silence = AlertSilence.objects.get()
    assert (silence.rule_id, silence.pool_id, silence.created_by.username, silence.comment) == (
        firing.rule_id, firing.pool_id, "otto", "known, fixing")
    assert silence.ends_at - silence.starts_at == timedelta(seconds=3600) and silence.starts_at >= before
    assert r.json()["silenced_until"] == silence.ends_at.isoformat().replace("+00:00", "Z")
    listed = operator_api.get("/api/v1/alerts/?state=firing").json()["results"]
    assert [(a["id"], a["silenced_until"]) for a in listed] == [(firing.pk, r.json()["silenced_until"])]

    r = operator_api.post(f"/api/v1/alerts/{firing.pk}/unsilence/")
    assert (r.status_code, r.json()["silenced_until"]) == (200, None)
    assert operator_api.post(f"/api/v1/alerts/{firing.pk}/unsilence/").status_code == 200  # nothing to end
    audit = _audit(firing)
    assert [(k, s, u) for k, s, u, _ in audit] == [("alert.silence", "succeeded", "otto"),
                                                   ("alert.unsilence", "succeeded", "otto")]
    assert audit[0][3] == {"rule": "kv-cache-usage-critical", "pool_id": firing.pool_id, "duration_s": 3600,
                           "until": silence.ends_at.isoformat(), "silence_id": silence.pk, "comment": "known, fixing"}
    assert audit[1][3] == {"rule": "kv-cache-usage-critical", "pool_id": firing.pool_id, "ended": 1}


def test_a_silenced_rule_does_not_notify_when_it_resolves_or_fires_again_and_notifies_after_unsilence(
        operator_api, pool, history, webhook, django_capture_on_commit_callbacks):
    url, received = webhook
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    AlertRule.objects.filter(pk=rule.pk).update(webhook_url=url)
    spec = RuleSpec(key=str(rule.pk), name=rule.name, signal=rule.signal, comparison=rule.comparison,
                    threshold=rule.threshold, severity=rule.severity)
    evaluator = AlertEvaluator()

    def poll(value: float, at_s: float) -> None:
        with django_capture_on_commit_callbacks(execute=True):
            transitions = evaluator.evaluate([spec], str(pool.pk), {"kv_cache_usage_max": value}, at_s)
            alert_transitions_apply(pool_id=pool.pk, transitions=transitions, history=history)

    t0 = datetime.now(tz=UTC).timestamp()
    poll(0.97, t0)
    first = Alert.objects.get(pool=pool, state="firing")
    assert [(m["id"], m["state"], m["silenced_until"]) for m in received] == [(first.pk, "firing", None)]
    with django_capture_on_commit_callbacks(execute=True):
        assert operator_api.post(f"/api/v1/alerts/{first.pk}/silence/", {"duration_s": 600},
                                 format="json").status_code == 200
    poll(0.5, t0 + 1)   # resolves: silenced, no POST
    poll(0.99, t0 + 2)  # the same rule fires again on the pool within the silence: no POST
    assert len(received) == 1
    second = Alert.objects.get(pool=pool, state="firing")
    assert operator_api.get(f"/api/v1/alerts/{second.pk}/").json()["silenced_until"] is not None
    with django_capture_on_commit_callbacks(execute=True):
        assert operator_api.post(f"/api/v1/alerts/{second.pk}/unsilence/").status_code == 200
    poll(0.5, t0 + 3)   # resolves after the silence ended: notified
    assert [(m["id"], m["state"], m["silenced_until"]) for m in received] == [
        (first.pk, "firing", None), (second.pk, "resolved", None)]
