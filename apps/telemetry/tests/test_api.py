"""The telemetry REST API: alert rules (admin writes), alerts, signal snapshots and history."""

import time
from datetime import UTC, datetime

import pytest

from apps.telemetry.history import SignalHistory
from apps.telemetry.models import Alert, AlertRule


@pytest.fixture
def redis_history(settings):
    """The default-prefix history the API reads, emptied before and after."""
    history = SignalHistory()
    history.clear()
    yield history
    history.clear()


def test_admin_sets_a_pool_threshold_and_viewer_cannot(admin_api, viewer_api, pool):
    body = {"name": "ttft-p99-high", "pool": pool.pk, "signal": "ttft_p99_s", "comparison": ">", "threshold": 1.5,
            "for_seconds": 30, "severity": "critical"}
    assert viewer_api.post("/api/v1/alert-rules/", body, format="json").status_code == 403
    response = admin_api.post("/api/v1/alert-rules/", body, format="json")
    assert response.status_code == 201, response.json()
    rule = AlertRule.objects.get(pk=response.json()["id"])
    assert (rule.pool_id, rule.threshold, rule.for_seconds, rule.severity) == (pool.pk, 1.5, 30, "critical")
    again = admin_api.post("/api/v1/alert-rules/", body, format="json")
    assert again.status_code == 400
    assert "This pool already has a rule with this name." in str(again.json())


def test_rule_writes_refuse_a_misspelt_field_instead_of_keeping_the_default(admin_api, pool):
    """``for_secs`` was dropped: the rule fired at once (for_seconds 0) instead of after 30 s."""
    body = {"name": "ttft-p99-high", "pool": pool.pk, "signal": "ttft_p99_s", "comparison": ">", "threshold": 1.5,
            "for_secs": 30, "created_at": "2020-01-01T00:00:00Z"}
    response = admin_api.post("/api/v1/alert-rules/", body, format="json")
    assert (response.status_code, response.json()) == (400, {
        "for_secs": ["Unknown field: it is not part of this resource."], "created_at": ["This field is read-only."]})
    assert not AlertRule.objects.filter(pool=pool).exists()
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    response = admin_api.patch(f"/api/v1/alert-rules/{rule.pk}/", {"threshold": 0.5, "for_secs": 30}, format="json")
    assert (response.status_code, list(response.json())) == (400, ["for_secs"])
    rule.refresh_from_db()
    assert rule.threshold != 0.5


def test_rule_with_unknown_signal_is_rejected_with_the_choices(admin_api):
    body = {"name": "x", "signal": "gpu_temp", "comparison": ">", "threshold": 1}
    response = admin_api.post("/api/v1/alert-rules/", body, format="json")
    assert response.status_code == 400
    assert "gpu_temp" in str(response.json())


def test_fleet_defaults_filter_and_alert_list(viewer_api, pool, django_assert_max_num_queries):
    defaults = viewer_api.get("/api/v1/alert-rules/?fleet_default=true").json()
    assert {r["name"] for r in defaults["results"]} >= {"ttft-p99-high", "kv-cache-usage-critical"}
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    for i in range(3):
        Alert.objects.create(rule=rule, pool=pool, state="resolved", severity="critical", value=0.97,
                             started_at=datetime(2026, 11, 30, 6, i, tzinfo=UTC),
                             ended_at=datetime(2026, 11, 30, 6, i, 30, tzinfo=UTC))
    with django_assert_max_num_queries(6):  # auth + count + one page with its rules: no per-row queries
        response = viewer_api.get(f"/api/v1/alerts/?pool={pool.pk}&state=resolved")
    rows = response.json()["results"]
    assert [(r["rule_name"], r["started_at"]) for r in rows] == [
        ("kv-cache-usage-critical", "2026-11-30T06:02:00Z"),
        ("kv-cache-usage-critical", "2026-11-30T06:01:00Z"),
        ("kv-cache-usage-critical", "2026-11-30T06:00:00Z"),
    ]


def test_signals_snapshot_and_history_come_from_redis(viewer_api, pool, redis_history):
    now = time.time()
    for i, at in enumerate((now - 1000, now - 20, now - 10)):
        redis_history.append(f"pool:{pool.pk}", at, {"seq": i + 1, "at": at, "pool_id": pool.pk,
                                                      "signals": {"request_rate_per_s": float(i)}})
    snapshot = viewer_api.get(f"/api/v1/signals/{pool.pk}/").json()
    assert (snapshot["seq"], snapshot["signals"]) == (3, {"request_rate_per_s": 2.0})
    records = viewer_api.get(f"/api/v1/signals/{pool.pk}/history/").json()["records"]
    assert [r["seq"] for r in records] == [2, 3]  # the 1000 s old record is outside the 15 minutes
    since = viewer_api.get(f"/api/v1/signals/{pool.pk}/history/?since={now - 15}").json()["records"]
    assert [r["seq"] for r in since] == [3]
    assert viewer_api.get(f"/api/v1/signals/{pool.pk}/history/?since=yesterday").status_code == 400
    assert viewer_api.get("/api/v1/signals/999999/").status_code == 404
    assert viewer_api.get("/api/v1/signals/").json() == {}  # no fleet record yet


def test_latest_signal_for_autoscaler_is_none_when_stale_or_missing(pool, history):
    from apps.telemetry.selectors import telemetry_signal

    assert telemetry_signal(pool_id=pool.pk, name="num_requests_waiting", history=history) is None
    history.append(f"pool:{pool.pk}", 1000.0, {"seq": 1, "at": 1000.0, "signals": {"num_requests_waiting": 4.0},
                                               "tracks": {"canary": {"num_requests_waiting": 1.0}}})
    get = lambda **kw: telemetry_signal(pool_id=pool.pk, history=history, **kw)  # noqa: E731
    assert get(name="num_requests_waiting", now_s=1005.0) == 4.0
    assert get(name="num_requests_waiting", track="canary", now_s=1005.0) == 1.0
    assert get(name="num_requests_waiting", track="blue", now_s=1005.0) is None
    assert get(name="num_requests_waiting", now_s=1011.0) is None  # poller stopped: stale is no data
    with pytest.raises(KeyError, match="unknown signal"):
        get(name="queue_depth", now_s=1005.0)
