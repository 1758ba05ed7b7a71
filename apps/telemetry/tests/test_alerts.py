"""Every default alert rule fires and clears on synthetic series with the right start and end."""

import pytest
import yaml

from apps.telemetry.alerts import DEFAULT_RULES, AlertEvaluator, RuleSpec, prometheus_rules


def run(rule, series):
    """Feed ``[(t, value)]`` for the rule's signal; return the transitions with their poll time."""
    evaluator = AlertEvaluator()
    out = []
    for t, value in series:
        for tr in evaluator.evaluate([rule], "7", {rule.signal: value}, float(t)):
            out.append((t, tr.kind, tr.started_at_s, tr.ended_at_s, tr.value))
    return out


def spec(name):
    data = next(r for r in DEFAULT_RULES if r["name"] == name)
    return RuleSpec(key=name, **data)


def every(step, start, stop, value):
    return [(t, value) for t in range(start, stop, step)]


# (rule, series, expected [(poll time, kind, started_at, ended_at, value)])
CASES = [
    # GPU utilization < 60% for 5 min, polled every 10 s: low from t=100; fires at t=400 (held
    # 300 s) with start 100; back to 80% at t=600 resolves with end 600.
    ("gpu-utilization-low", every(10, 0, 100, 0.8) + every(10, 100, 600, 0.4) + every(10, 600, 700, 0.8),
     [(400, "fired", 100.0, None, 0.4), (600, "resolved", 100.0, 600.0, 0.8)]),
    # Breaks after 290 s: never fires (pending resets).
    ("gpu-utilization-low", every(10, 0, 290, 0.5) + every(10, 290, 400, 0.9) + every(10, 400, 690, 0.5), []),
    ("ttft-p99-high", [(0, 0.2), (1, 0.51), (2, 0.9), (3, 0.5), (4, 0.3)],
     [(1, "fired", 1.0, None, 0.51), (3, "resolved", 1.0, 3.0, 0.5)]),
    ("request-failure-rate-high", [(0, 0.0), (1, 0.02), (2, 0.011), (3, 0.01)],
     [(1, "fired", 1.0, None, 0.02), (3, "resolved", 1.0, 3.0, 0.01)]),
    # KV > 90% for 1 min, polled every 5 s: high from 20, fires at 80, clears at 120.
    ("kv-cache-usage-high", every(5, 0, 20, 0.5) + every(5, 20, 120, 0.93) + every(5, 120, 140, 0.7),
     [(80, "fired", 20.0, None, 0.93), (120, "resolved", 20.0, 120.0, 0.7)]),
    ("kv-cache-usage-critical", [(0, 0.9), (1, 0.96), (2, 0.97), (3, 0.95)],
     [(1, "fired", 1.0, None, 0.96), (3, "resolved", 1.0, 3.0, 0.95)]),
    ("kv-transfer-failure-rate-high", [(0, 0.0), (1, 0.05), (2, 0.0)],
     [(1, "fired", 1.0, None, 0.05), (2, "resolved", 1.0, 2.0, 0.0)]),
    # No data never fires and ends a firing alert (like a vanished series in Prometheus).
    ("ttft-p99-high", [(0, None), (1, 0.7), (2, None), (3, None)],
     [(1, "fired", 1.0, None, 0.7), (2, "resolved", 1.0, 2.0, None)]),
]


@pytest.mark.parametrize(("name", "series", "expected"), CASES)
def test_default_rule_fires_and_clears_with_right_start_and_end(name, series, expected):
    assert run(spec(name), series) == expected


def test_every_default_rule_is_covered_by_a_case():
    assert {r["name"] for r in DEFAULT_RULES} == {c[0] for c in CASES}


def test_seed_thresholds_are_the_defaults():
    got = {r["name"]: (r["signal"], r["comparison"], r["threshold"], r["for_seconds"], r["severity"])
           for r in DEFAULT_RULES}
    assert got == {
        "gpu-utilization-low": ("gpu_utilization", "<", 0.60, 300, "warning"),
        "ttft-p99-high": ("ttft_p99_s", ">", 0.5, 0, "warning"),
        "request-failure-rate-high": ("error_rate", ">", 0.01, 0, "critical"),
        "kv-cache-usage-high": ("kv_cache_usage_max", ">", 0.90, 60, "warning"),
        "kv-cache-usage-critical": ("kv_cache_usage_max", ">", 0.95, 0, "critical"),
        "kv-transfer-failure-rate-high": ("kv_transfer_failure_rate", ">", 0.01, 0, "critical"),
    }


def test_restored_firing_alert_resolves_with_its_original_start():
    evaluator = AlertEvaluator()
    evaluator.restore_firing("ttft-p99-high", "7", 50.0)
    rule = spec("ttft-p99-high")
    assert evaluator.evaluate([rule], "7", {"ttft_p99_s": 0.9}, 60.0) == []
    (tr,) = evaluator.evaluate([rule], "7", {"ttft_p99_s": 0.1}, 61.0)
    assert (tr.kind, tr.started_at_s, tr.ended_at_s) == ("resolved", 50.0, 61.0)


def test_removed_rule_resolves_its_firing_alert():
    evaluator = AlertEvaluator()
    rule = spec("ttft-p99-high")
    evaluator.evaluate([rule], "7", {"ttft_p99_s": 0.9}, 1.0)
    (tr,) = evaluator.evaluate([], "7", {"ttft_p99_s": 0.9}, 2.0)
    assert (tr.kind, tr.rule_key, tr.ended_at_s) == ("resolved", "ttft-p99-high", 2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"signal": "nope"}, "unknown signal"),
        ({"comparison": "=="}, "comparison must be"),
        ({"for_seconds": -1}, "for_seconds must be"),
        ({"severity": "page"}, "severity must be"),
    ],
)
def test_invalid_rule_is_rejected(kwargs, message):
    base = {"key": "k", "name": "r", "signal": "error_rate", "comparison": ">", "threshold": 0.1}
    with pytest.raises(ValueError, match=message):
        RuleSpec(**{**base, **kwargs})


def test_prometheus_rules_export_defaults_per_pool_and_overrides():
    default = spec("kv-cache-usage-high")
    override = RuleSpec(key="9", name="kv-cache-usage-high", signal="kv_cache_usage_max", comparison=">",
                        threshold=0.8, for_seconds=30, severity="warning")
    silenced = RuleSpec(key="10", name="kv-cache-usage-high", signal="kv_cache_usage_max", comparison=">",
                        threshold=0.8, enabled=False)
    doc = prometheus_rules([(default, None), (override, "decode-a"), (silenced, "decode-b")], window_s=60)
    rules = yaml.safe_load(yaml.safe_dump(doc))["groups"][0]["rules"]
    assert rules == [
        {"alert": "FerryKvCacheUsageHigh",
         "expr": 'max by (pool) (ferry_kv_cache_usage_ratio{pool!~"decode-a|decode-b"}) > 0.9',
         "labels": {"severity": "warning", "ferry_rule": "kv-cache-usage-high"},
         "annotations": {"summary": default.description, "value": "{{ $value }}"}, "for": "60s"},
        {"alert": "FerryKvCacheUsageHigh", "expr": 'max by (pool) (ferry_kv_cache_usage_ratio{pool="decode-a"}) > 0.8',
         "labels": {"severity": "warning", "ferry_rule": "kv-cache-usage-high", "pool": "decode-a"},
         "annotations": {"summary": "kv_cache_usage_max > 0.8", "value": "{{ $value }}"}, "for": "30s"},
    ]


def test_regex_metacharacters_in_pool_names_are_escaped():
    rule = spec("ttft-p99-high")
    doc = prometheus_rules([(rule, None), (rule, "a.b")], window_s=30)
    assert 'pool!~"a\\\\.b"' in doc["groups"][0]["rules"][0]["expr"]
