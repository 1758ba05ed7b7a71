"""Signals evaluated over scraped samples (real worker metric registries) and rendered as PromQL."""

import pytest
from prometheus_client import generate_latest

from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.signals import SIGNAL_NAMES, SIGNAL_SPECS, Scope, evaluate_signals, labels_match
from apps.telemetry.sources.scrape import SampleStore
from inference_worker.metrics import WorkerMetrics


def worker(replica, track):
    identity = {"model": "gemma-3-270m", "model_version": "v1", "role": "colocated", "pool": "p1",
                "track": track, "replica": replica}
    return WorkerMetrics(identity), ReplicaEndpoint("p1", track, replica, f"http://127.0.0.1:1/{replica}")


@pytest.fixture
def store():
    """Two replicas scraped every second for 10 s with steady, known traffic.

    r0 (stable): 2 successful requests/s, TTFT 0.04 s, 10 generated tokens each, waiting 3, KV 0.5.
    r1 (canary): 3 successes + 1 server error per s, TTFT 0.2 s, waiting 5, KV 0.9; one KV
    transfer failure per 4 transfers.
    """
    store = SampleStore(retention_s=60)
    (w0, e0), (w1, e1) = worker("r0", "stable"), worker("r1", "canary")
    for w in (w0, w1):
        w.set_ready(True)
    w0.set_engine_state(num_waiting=3, num_running=2, kv_cache_usage=0.5, busy_ratio=0.25)
    w1.set_engine_state(num_waiting=5, num_running=4, kv_cache_usage=0.9, busy_ratio=0.75)
    for t in range(11):
        if t > 0:
            for _ in range(2):
                w0.request_finished("success")
                w0.tokens(num_prompt_tokens=7, num_generation_tokens=10)
                w0.observe_latency(ttft_s=0.04, e2e_s=0.04 + 9 * 0.01, num_output_tokens=10)
            for outcome in ("success", "success", "success", "server_error"):
                w1.request_finished(outcome)
                w1.observe_latency(ttft_s=0.2, e2e_s=0.2 + 9 * 0.05, num_output_tokens=10)
            for outcome in ("success", "success", "success", "failure"):
                w1.kv_transfer.transfers.labels(**w1.identity, direction="send", outcome=outcome,
                                                reason="none" if outcome == "success" else "timeout").inc()
            w1.kv_transfer.wire_bytes.labels(**w1.identity, direction="send").inc(1000)
        store.ingest(e0, generate_latest(w0.registry).decode(), float(t))
        store.ingest(e1, generate_latest(w1.registry).decode(), float(t))
    return store


# Every counter starts at 0 at t=0 and rises linearly, so rate(...[10s]) at t=10 is exact.
POOL = {
    "request_rate_per_s": 6.0,
    "error_rate": 1.0 / 6.0,
    "num_requests_waiting": 8.0,
    "num_requests_running": 6.0,
    "kv_cache_usage": 0.7,
    "kv_cache_usage_max": 0.9,
    # TTFT buckets per s: 2 at le=0.05, 6 at le=0.2. p50 rank 3 in (0.15, 0.2]: 0.15 + 0.05 * 1/4.
    "ttft_p50_s": 0.1625,
    # p95 rank 5.7 in (0.15, 0.2]: 0.15 + 0.05 * 3.7/4; p99 rank 5.94: 0.15 + 0.05 * 3.94/4.
    "ttft_p95_s": 0.19625,
    "ttft_p99_s": 0.19925,
    # TPOT 0.01 s (r0, 2/s, bucket (0.005, 0.01]) and 0.05 s (r1, 4/s, bucket (0.025, 0.05]).
    "tpot_p50_s": 0.025 + 0.025 * 1 / 4,
    "tpot_p95_s": 0.025 + 0.025 * 3.7 / 4,
    "tpot_p99_s": 0.025 + 0.025 * 3.94 / 4,
    "prompt_tokens_per_s": 14.0,
    "generation_tokens_per_s": 20.0,
    "kv_transfer_failure_rate": 0.25,
    "kv_transfer_bytes_per_s": 1000.0,
    "engine_busy_ratio": 0.5,
    "gpu_utilization": None,  # CPU workers export no GPU series: no data, never 0
    "ready_replicas": 2.0,
}


def test_pool_signals_aggregate_both_tracks(store):
    got = evaluate_signals(store.view(Scope("p1")), Scope("p1"), 10.0, 10.0, "scrape").values
    assert set(got) == set(SIGNAL_NAMES)
    for name, expected in POOL.items():
        assert got[name] == (None if expected is None else pytest.approx(expected, rel=1e-9)), name


@pytest.mark.parametrize(
    ("track", "expected"),
    [
        ("stable", {"request_rate_per_s": 2.0, "error_rate": 0.0, "ttft_p99_s": 0.025 + 0.025 * 1.98 / 2,
                    "kv_transfer_failure_rate": None, "kv_cache_usage": 0.5, "ready_replicas": 1.0}),
        ("canary", {"request_rate_per_s": 4.0, "error_rate": 0.25, "ttft_p99_s": 0.15 + 0.05 * 3.96 / 4,
                    "kv_transfer_failure_rate": 0.25, "kv_cache_usage": 0.9, "ready_replicas": 1.0}),
        ("blue", {"request_rate_per_s": None, "error_rate": None, "ttft_p99_s": None,
                  "kv_transfer_failure_rate": None, "kv_cache_usage": None, "ready_replicas": None}),
    ],
)
def test_track_signals_only_see_their_replicas(store, track, expected):
    got = evaluate_signals(store.view(Scope("p1", track)), Scope("p1", track), 10.0, 10.0, "scrape").values
    for name, value in expected.items():
        assert got[name] == (None if value is None else pytest.approx(value, rel=1e-9)), name


def test_down_replica_drops_out_of_gauges_and_ready_count_but_not_rates(store):
    _, e1 = worker("r1", "canary")
    store.mark_down(e1, 11.0)
    got = evaluate_signals(store.view(Scope("p1")), Scope("p1"), 10.0, 10.0, "scrape").values
    assert got["num_requests_waiting"] == 3.0
    assert got["kv_cache_usage_max"] == 0.5
    assert got["ready_replicas"] == 1.0
    assert got["request_rate_per_s"] == pytest.approx(6.0)


def test_no_traffic_window_is_no_data_for_ratios_and_quantiles(store):
    # Window (20, 30] holds no samples: every rate and quantile is "no data".
    got = evaluate_signals(store.view(Scope("p1")), Scope("p1"), 30.0, 10.0, "scrape").values
    assert got["request_rate_per_s"] is None
    assert got["error_rate"] is None
    assert got["ttft_p99_s"] is None


def test_prune_forgets_samples_older_than_retention(store):
    store.prune(now_s=65.0)  # retention 60 s: only t >= 5 survives
    got = evaluate_signals(store.view(Scope("p1")), Scope("p1"), 10.0, 10.0, "scrape").values
    # Samples t=5..10 cover 5 s of the 10 s range; the series now starts 5 s after the range
    # start, so Prometheus extrapolates only half an interval: 6/s * (5 + 0.5) s / 10 s.
    assert got["request_rate_per_s"] == pytest.approx(3.3)


@pytest.mark.parametrize(
    ("name", "scope", "window_s", "promql"),
    [
        ("request_rate_per_s", Scope("p1"), 30, 'sum(rate(ferry_requests_total{pool="p1"}[30s]))'),
        (
            "error_rate",
            Scope("p1", "canary"),
            1.5,
            '(sum(rate(ferry_requests_total{pool="p1",track="canary",outcome=~"server_error"}[1500ms]))'
            ' or vector(0)) / sum(rate(ferry_requests_total{pool="p1",track="canary"}[1500ms]))',
        ),
        (
            "ttft_p99_s",
            Scope("p1"),
            60,
            'histogram_quantile(0.99, sum by (le) (rate(ferry_time_to_first_token_seconds_bucket{pool="p1"}[60s])))',
        ),
        ("kv_cache_usage_max", Scope('p"1'), 30, 'max(ferry_kv_cache_usage_ratio{pool="p\\"1"})'),
        ("ready_replicas", Scope("p1"), 30, 'sum(ferry_worker_ready{pool="p1"})'),
    ],
)
def test_signal_specs_render_promql(name, scope, window_s, promql):
    assert SIGNAL_SPECS[name].promql(scope.matchers(), window_s) == promql


@pytest.mark.parametrize(
    ("labels", "matchers", "expected"),
    [
        ({"outcome": "server_error"}, [("outcome", "=~", "server_error|aborted")], True),
        ({"outcome": "success"}, [("outcome", "!~", "success")], False),
        ({}, [("track", "=", "")], True),
        ({"track": "canary"}, [("track", "!=", "stable")], True),
    ],
)
def test_label_matchers_follow_promql(labels, matchers, expected):
    assert labels_match(labels, matchers) is expected


def test_unknown_matcher_operator_is_rejected():
    with pytest.raises(ValueError, match="unknown label matcher operator"):
        labels_match({"a": "b"}, [("a", "==", "b")])
