"""Alert state in the database (start/end), defaults from the migration, webhook, rules export."""

import io
import shutil
import subprocess
from datetime import UTC, datetime

import pytest
import yaml
from django.core.management import call_command

from apps.telemetry.alerts import DEFAULT_RULES, AlertEvaluator, RuleSpec
from apps.telemetry.models import Alert, AlertRule
from apps.telemetry.selectors import alert_rules_effective
from apps.telemetry.services import alert_notify, alert_rules_load_defaults, alert_transitions_apply


@pytest.mark.django_db
def test_migration_created_the_default_rules_and_loading_again_is_idempotent():
    names = set(AlertRule.objects.filter(pool=None).values_list("name", flat=True))
    assert names == {r["name"] for r in DEFAULT_RULES}
    AlertRule.objects.filter(name="ttft-p99-high").update(threshold=0.8)
    assert alert_rules_load_defaults() == 0
    assert AlertRule.objects.get(name="ttft-p99-high", pool=None).threshold == 0.8  # edits are kept


def test_pool_rule_overrides_default_and_disabled_override_silences_it(pool, make_pool):
    other = make_pool("decode-b")
    AlertRule.objects.create(name="ttft-p99-high", pool=pool, signal="ttft_p99_s", comparison=">", threshold=1.0)
    AlertRule.objects.create(name="kv-cache-usage-critical", pool=other, signal="kv_cache_usage_max",
                             comparison=">", threshold=0.95, enabled=False)
    rules = alert_rules_effective([pool.pk, other.pk])
    ttft = {p: [r.threshold for r in rules[p] if r.name == "ttft-p99-high"] for p in (pool.pk, other.pk)}
    assert ttft == {pool.pk: [1.0], other.pk: [0.5]}
    assert "kv-cache-usage-critical" in {r.name for r in rules[pool.pk]}
    assert "kv-cache-usage-critical" not in {r.name for r in rules[other.pk]}


def test_transitions_are_stored_with_start_and_end_and_sent_to_the_webhook(
    pool, history, webhook, django_capture_on_commit_callbacks
):
    url, received = webhook
    rule = AlertRule.objects.get(name="kv-cache-usage-high", pool=None)
    AlertRule.objects.filter(pk=rule.pk).update(webhook_url=url)
    spec = RuleSpec(key=str(rule.pk), name=rule.name, signal=rule.signal, comparison=rule.comparison,
                    threshold=rule.threshold, for_seconds=rule.for_seconds, severity=rule.severity)
    evaluator = AlertEvaluator()
    t0 = 1_780_000_000.0
    for i in range(0, 100, 5):  # KV 0.95 from t0+0 to t0+95: fires at t0+60 with start t0
        with django_capture_on_commit_callbacks(execute=True):
            transitions = evaluator.evaluate([spec], str(pool.pk), {"kv_cache_usage_max": 0.95}, t0 + i)
            if transitions:
                alert_transitions_apply(pool_id=pool.pk, transitions=transitions, history=history)
    alert = Alert.objects.get(pool=pool)
    assert (alert.state, alert.started_at, alert.ended_at, alert.value) == (
        "firing", datetime.fromtimestamp(t0, tz=UTC), None, 0.95)
    with django_capture_on_commit_callbacks(execute=True):
        transitions = evaluator.evaluate([spec], str(pool.pk), {"kv_cache_usage_max": 0.5}, t0 + 100)
        alert_transitions_apply(pool_id=pool.pk, transitions=transitions, history=history)
    alert.refresh_from_db()
    assert (alert.state, alert.ended_at) == ("resolved", datetime.fromtimestamp(t0 + 100, tz=UTC))
    assert [(m["rule"], m["state"], m["started_at"], m["ended_at"]) for m in received] == [
        ("kv-cache-usage-high", "firing", "2026-05-28T20:26:40+00:00", None),
        ("kv-cache-usage-high", "resolved", "2026-05-28T20:26:40+00:00", "2026-05-28T20:28:20+00:00"),
    ]


def test_webhook_failure_is_logged_not_raised(caplog):
    assert alert_notify(url="http://127.0.0.1:9/unreachable", payload={"id": 1}, timeout_s=0.5) is False
    assert "alert webhook http://127.0.0.1:9/unreachable failed" in caplog.text


def test_rules_command_prints_prometheus_rules_file(pool, tmp_path):
    AlertRule.objects.create(name="ttft-p99-high", pool=pool, signal="ttft_p99_s", comparison=">", threshold=1.0)
    out = io.StringIO()
    call_command("telemetry_rules", stdout=out)
    doc = yaml.safe_load(out.getvalue())
    rules = doc["groups"][0]["rules"]
    assert len(rules) == len(DEFAULT_RULES) + 1
    exprs = [r["expr"] for r in rules if r["labels"]["ferry_rule"] == "ttft-p99-high"]
    assert exprs == [
        'histogram_quantile(0.99, sum by (pool, le) (rate(ferry_time_to_first_token_seconds_bucket{pool!~"decode"}[60s])))'
        " > 0.5",
        'histogram_quantile(0.99, sum by (pool, le) (rate(ferry_time_to_first_token_seconds_bucket{pool="decode"}[60s])))'
        " > 1",
    ]
    promtool = shutil.which("promtool")
    if promtool:  # Debian's prometheus package ships it; CI installs it
        path = tmp_path / "rules.yml"
        path.write_text(out.getvalue())
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {len(rules)} rules found" in result.stdout, result.stdout + result.stderr
