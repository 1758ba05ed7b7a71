"""Signals evaluated over scraped samples (real worker metric registries) and rendered as PromQL."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

from apps.telemetry import metric_names as m
from apps.telemetry.endpoints import ReplicaEndpoint, RouterEndpoint
from apps.telemetry.signals import (
    SIGNAL_NAMES,
    SIGNAL_SPECS,
    Scope,
    evaluate_signals,
    kv_transfer_breakdown,
    kv_transfer_breakdown_promql,
    labels_match,
)
from apps.telemetry.sources.scrape import SampleStore
from inference_worker.metrics import WorkerMetrics
from inference_worker.router.decisions import DECISIONS, LOCAL_PREFILL_FALLBACK
from inference_worker.router.metrics import RouterMetrics


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
    "router_local_prefill_per_s": None,  # no router scraped: no data
    "router_remote_prefill_per_s": None,
    "router_local_prefill_fallback_per_s": None,
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


# --- Router decisions: series labelled with the decode pool's name, scraped from routers that belong to no pool.

ROUTER_SIGNALS = ("router_local_prefill_per_s", "router_remote_prefill_per_s", "router_local_prefill_fallback_per_s")


def router(url="http://127.0.0.1:1/r0"):
    return RouterMetrics(), RouterEndpoint(url)


def router_text(metrics):
    return generate_latest(metrics.registry).decode()


def test_control_plane_decision_names_are_the_routers():
    local, remote = set(m.ROUTER_LOCAL_PREFILL_DECISIONS), set(m.ROUTER_REMOTE_PREFILL_DECISIONS)
    assert local | remote == set(DECISIONS) and not local & remote
    assert set(m.ROUTER_LOCAL_PREFILL_FALLBACK_DECISIONS) == {LOCAL_PREFILL_FALLBACK} <= local
    assert RouterMetrics().decisions._name + "_total" == m.ROUTER_DECISIONS


@pytest.mark.parametrize("window_s", [10.5, 15.0, 16.0])
def test_two_scrapes_ten_seconds_apart_counting_3_then_8_give_half_a_request_per_second(window_s):
    # Prometheus extrapolates the increase (5 over 10 s) to the window start, no further than where the
    # counter would have been 0 (6 s before the first sample): any window of (10, 16] s gives 5 * 0.1/s.
    store = SampleStore(retention_s=60)
    metrics, endpoint = router()
    child = metrics.decisions.labels(pool="decode", decision="local_prefill", track="stable")
    child.inc(3)
    store.ingest(endpoint, router_text(metrics), 0.0)
    child.inc(5)
    store.ingest(endpoint, router_text(metrics), 10.0)
    scope = Scope("7", label="decode")
    got = evaluate_signals(store.view(scope), scope, 10.0, window_s, "scrape").values
    assert got["router_local_prefill_per_s"] == pytest.approx(0.5, rel=1e-12)
    assert got["router_remote_prefill_per_s"] is None  # never counted: no series, no data
    assert got["request_rate_per_s"] is None  # the router is no replica of the pool



def test_single_decisions_that_create_their_series_count_from_zero():
    # The user's two requests: the router's first local and first remote decision each create a labelled
    # series at 1. Scraped before (no series) and after, each is 1 request over the 15 s window, not 0/s.
    store = SampleStore(retention_s=60)
    metrics, endpoint = router()
    store.ingest(endpoint, router_text(metrics), 0.0)
    metrics.decisions.labels(pool="decode", decision="local_prefill", track="stable").inc()
    metrics.decisions.labels(pool="decode", decision="remote_prefill", track="stable").inc()
    scope = Scope("7", label="decode")
    for at in (1.0, 2.0, 14.0):  # the same rate while the creation stays inside the window
        store.ingest(endpoint, router_text(metrics), at)
        got = evaluate_signals(store.view(scope), scope, at, 15.0, "scrape").values
        assert (got["router_local_prefill_per_s"], got["router_remote_prefill_per_s"]) == (
            pytest.approx(1 / 15, rel=1e-12), pytest.approx(1 / 15, rel=1e-12))
    store.ingest(endpoint, router_text(metrics), 16.0)  # the 0 at t=0 has left the window: no more increase
    got = evaluate_signals(store.view(scope), scope, 16.0, 15.0, "scrape").values
    assert got["router_local_prefill_per_s"] == 0.0


def exposition(*, counter=None, histogram=None, summary=None, gauge=None):
    """Text of one labelled series of each kind that is given (its value: a counter/gauge value,
    or one observation for the histogram and summary)."""
    registry = CollectorRegistry()
    if counter is not None:
        Counter("c", "counter", ["k"], registry=registry).labels(k="a").inc(counter)
    if histogram is not None:
        Histogram("h", "histogram", ["k"], buckets=(1.0,), registry=registry).labels(k="a").observe(histogram)
    if summary is not None:
        Summary("s", "summary", ["k"], registry=registry).labels(k="a").observe(summary)
    if gauge is not None:
        Gauge("g", "gauge", ["k"], registry=registry).labels(k="a").set(gauge)
    return generate_latest(registry).decode()


ALL_KINDS = {"counter": 2.0, "histogram": 0.5, "summary": 0.5, "gauge": 4.0}
CREATED = {"c_total": [(1.0, 0.0), (2.0, 2.0)], "h_bucket": [(1.0, 0.0), (2.0, 1.0)],
           "h_count": [(1.0, 0.0), (2.0, 1.0)], "h_sum": [(1.0, 0.0), (2.0, 0.5)],
           "s_count": [(1.0, 0.0), (2.0, 1.0)], "s_sum": [(1.0, 0.0), (2.0, 0.5)], "g": [(2.0, 4.0)]}


@pytest.mark.parametrize("case, scrapes, expected", [
    # Created between two answered scrapes: monotonic series get a 0 at the earlier one, gauges none.
    ("created between scrapes", [(1.0, {}), (2.0, ALL_KINDS)], CREATED),
    # Already there at the endpoint's first scrape: its past is unknown, nothing is added.
    ("there at the first scrape", [(2.0, ALL_KINDS)], {k: [v[-1]] for k, v in CREATED.items()}),
    # The scrape before failed: when the series appeared is unknown, nothing is added.
    ("after a failed scrape", [(0.0, {}), (1.0, None), (2.0, ALL_KINDS)], {k: [v[-1]] for k, v in CREATED.items()}),
    # Gone from one scrape (the process restarted) and back: the 0 makes the restart a counter reset.
    ("restarted", [(0.0, {"counter": 5.0}), (1.0, {}), (2.0, {"counter": 2.0})],
     {"c_total": [(0.0, 5.0), (1.0, 0.0), (2.0, 2.0)]}),
])
def test_a_monotonic_series_created_between_answered_scrapes_starts_at_zero(case, scrapes, expected):
    store = SampleStore(retention_s=60)
    endpoint = ReplicaEndpoint("p1", "stable", "r0", "http://127.0.0.1:1/r0")
    for at, kinds in scrapes:
        if kinds is None:
            store.mark_down(endpoint, at)
        else:
            store.ingest(endpoint, exposition(**kinds), at)
    got = {name: list(samples) for (_, name, labels), samples in store._series.items() if dict(labels).get("k") == "a"
           and not (name == "h_bucket" and dict(labels)["le"] == "+Inf")}
    assert got == expected, case


def untracked_router():
    """A router from before the ``track`` label: ``ferry_router_decisions_total{pool, decision}``."""
    registry = CollectorRegistry()
    return registry, Counter("ferry_router_decisions", "Requests routed.", ["pool", "decision"], registry=registry)


@pytest.fixture
def routed():
    """Two routers scraped every second for 10 s with steady, known decisions per second.

    r0 (the router's RouterMetrics, with a track label): for "decode" 1 local_prefill on stable and 1 on
    canary, 1 remote_prefill on stable, 1 local_prefill_fallback on canary; for "other" 5 local_prefill.
    r1 (an older router without the track label): for "decode" 3 remote_prefill.
    """
    store = SampleStore(retention_s=60)
    r0, e0 = router("http://10.0.0.1:8080")
    (registry1, decisions1), e1 = untracked_router(), RouterEndpoint("http://10.0.0.2:8080/metrics")
    for t in range(11):
        if t > 0:
            r0.decisions.labels(pool="decode", decision="local_prefill", track="stable").inc()
            r0.decisions.labels(pool="decode", decision="local_prefill", track="canary").inc()
            r0.decisions.labels(pool="decode", decision="remote_prefill", track="stable").inc()
            r0.decisions.labels(pool="decode", decision="local_prefill_fallback", track="canary").inc()
            r0.decisions.labels(pool="other", decision="local_prefill", track="stable").inc(5)
            decisions1.labels(pool="decode", decision="remote_prefill").inc(3)
        store.ingest(e0, router_text(r0), float(t))
        store.ingest(e1, generate_latest(registry1).decode(), float(t))
    return store, e0, e1


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        # local = local_prefill + fallback; summed over routers and over the track label.
        (Scope("7", label="decode"), (3.0, 4.0, 1.0)),
        (Scope("8", label="other"), (5.0, None, None)),
        (Scope("7", "stable", label="decode"), (1.0, 1.0, None)),  # r1 has no track label: not in a track
        (Scope("7", "canary", label="decode"), (2.0, None, 1.0)),
        (Scope("9", label="idle"), (None, None, None)),
        (Scope("decode"), (3.0, 4.0, 1.0)),  # no label: the pool is its own label (the Prometheus scopes)
    ],
)
def test_router_decisions_count_for_the_pool_and_track_their_labels_name(routed, scope, expected):
    store, _, _ = routed
    got = evaluate_signals(store.view(scope), scope, 10.0, 10.0, "scrape").values
    assert tuple(got[name] for name in ROUTER_SIGNALS) == tuple(
        None if e is None else pytest.approx(e, rel=1e-12) for e in expected)


def test_router_series_are_not_pool_replicas(routed, store):
    routers, _, _ = routed
    scope = Scope("p1", label="decode")
    view = store.view(scope, routers)  # the workers' store plus the shared router store
    got = evaluate_signals(view, scope, 10.0, 10.0, "scrape").values
    assert got["router_local_prefill_per_s"] == pytest.approx(3.0)
    assert got["request_rate_per_s"] == pytest.approx(6.0) and got["ready_replicas"] == 2.0
    assert routers.view(scope).ready_replicas() is None  # a router is no replica


def test_a_restarted_router_counts_from_zero_again_without_a_negative_rate():
    # 1 decision/s; the router restarts between t=5 and t=6 and counts the decision of that second again.
    store = SampleStore(retention_s=60)
    endpoint = RouterEndpoint("http://127.0.0.1:1")
    for t, count in enumerate((0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5)):
        metrics = RouterMetrics()
        if count:
            metrics.decisions.labels(pool="decode", decision="remote_prefill", track="stable").inc(count)
        store.ingest(endpoint, router_text(metrics), float(t))
    scope = Scope("7", label="decode")
    got = evaluate_signals(store.view(scope), scope, 10.0, 10.0, "scrape").values
    assert got["router_remote_prefill_per_s"] == pytest.approx(1.0, rel=1e-12)  # not (5 - 1) / 9 s


def test_an_unreachable_router_keeps_its_counted_decisions_in_the_window(routed):
    store, e0, e1 = routed
    store.mark_down(e1, 11.0)
    scope = Scope("7", label="decode")
    got = evaluate_signals(store.view(scope), scope, 10.0, 10.0, "scrape").values
    assert got["router_remote_prefill_per_s"] == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("name", "scope", "promql"),
    [
        ("router_local_prefill_per_s", Scope("decode"),
         'sum(rate(ferry_router_decisions_total{pool="decode",decision=~"local_prefill|local_prefill_fallback"}[30s]))'),
        ("router_remote_prefill_per_s", Scope("decode", "canary"),
         'sum(rate(ferry_router_decisions_total{pool="decode",track="canary",decision=~"remote_prefill"}[30s]))'),
        ("router_local_prefill_fallback_per_s", Scope("7", label="decode"),
         'sum(rate(ferry_router_decisions_total{pool="decode",decision=~"local_prefill_fallback"}[30s]))'),
    ],
)
def test_router_signals_render_promql_on_the_pool_label(name, scope, promql):
    assert SIGNAL_SPECS[name].promql(scope.matchers(), 30) == promql


def test_router_ejections_count_for_the_pool_and_track_of_the_ejected_replica():
    # One router: the breaker ejects canary replica c0 at t=5 (reason error_rate); s0 and c0 have a 0/1 series.
    store = SampleStore(retention_s=60)
    metrics, endpoint = router()
    for name, track in (("s0", "stable"), ("c0", "canary")):
        metrics.replica_ejected.labels(pool="decode", track=track, replica=name).set(0)
    for t in range(11):
        if t == 5:
            metrics.ejections.labels(pool="decode", track="canary", replica="c0", reason="error_rate").inc()
            metrics.replica_ejected.labels(pool="decode", track="canary", replica="c0").set(1)
        store.ingest(endpoint, router_text(metrics), float(t))
    expected = {"canary": (0.1, 1.0), "stable": (None, 0.0), None: (0.1, 1.0)}
    for track, (rate, ejected) in expected.items():
        scope = Scope("7", track, label="decode")
        got = evaluate_signals(store.view(scope), scope, 10.0, 10.0, "scrape").values
        assert got["router_ejected_replicas"] == ejected, track
        assert got["router_ejections_per_s"] == (None if rate is None else pytest.approx(rate, rel=1e-12)), track


def test_replica_ejections_sum_the_routers_counters_per_replica_of_the_pool():
    from apps.telemetry.poller import replica_ejections

    store = SampleStore(retention_s=60)
    r0, e0 = router("http://10.0.0.1:8080")
    r1, e1 = router("http://10.0.0.2:8080")
    r0.ejections.labels(pool="decode", track="canary", replica="c0", reason="error_rate").inc(2)
    r0.ejections.labels(pool="decode", track="canary", replica="c0", reason="probe_failed").inc()
    r1.ejections.labels(pool="decode", track="canary", replica="c0", reason="consecutive_failures").inc()
    r1.ejections.labels(pool="decode", track="stable", replica="s0", reason="error_rate").inc()
    r1.ejections.labels(pool="other", track="stable", replica="o0", reason="error_rate").inc(5)
    store.ingest(e0, router_text(r0), 1.0)
    store.ingest(e1, router_text(r1), 1.0)
    assert replica_ejections(store, Scope("7", label="decode")) == {"c0": 4.0, "s0": 1.0}
    assert replica_ejections(store, Scope("7", "canary", label="decode")) == {"c0": 4.0, "s0": 1.0}  # whole pool
    assert replica_ejections(store, Scope("other")) == {"o0": 5.0}
    assert replica_ejections(store, Scope("9", label="idle")) == {}


# --- Prefix cache (issue 18): hit rate in tokens, device-tier blocks, the router index's accuracy.


def test_prefix_cache_hit_rate_device_blocks_and_router_index_accuracy_over_ten_seconds():
    # r0 looks up 100 prompt tokens/s and finds 60 cached, r1 looks up 50/s and finds none: 60 / 150 = 0.4.
    # Blocks cached now: r0 30 (full) + 30 (sliding, not counted), r1 10. The router predicted 48 cached
    # tokens/s for pool p1 where the workers reported 50/s: accuracy 0.96. Another pool's router series is ignored.
    store = SampleStore(retention_s=60)
    (w0, e0), (w1, e1) = worker("r0", "stable"), worker("r1", "canary")
    metrics, endpoint = router()
    prev0: dict = {}
    prev1: dict = {}
    for t in range(11):
        s0 = {"query_tokens": 100 * t, "hit_tokens": 60 * t, "evictions": {},
              "cached_blocks": {"full_attention": 30, "sliding_attention": 30}}
        s1 = {"query_tokens": 50 * t, "hit_tokens": 0, "evictions": {}, "cached_blocks": {"full_attention": 10}}
        w0.prefix_cache(s0, prev0)
        w1.prefix_cache(s1, prev1)
        prev0, prev1 = s0, s1
        if t > 0:
            metrics.predicted_cached.labels(pool="p1").inc(48)
            metrics.reported_cached.labels(pool="p1").inc(50)
            metrics.predicted_cached.labels(pool="other").inc(1000)
            metrics.reported_cached.labels(pool="other").inc(1)
        store.ingest(e0, generate_latest(w0.registry).decode(), float(t))
        store.ingest(e1, generate_latest(w1.registry).decode(), float(t))
        store.ingest(endpoint, router_text(metrics), float(t))
    got = evaluate_signals(store.view(Scope("p1")), Scope("p1"), 10.0, 10.0, "scrape").values
    assert got["prefix_cache_hit_rate"] == pytest.approx(0.4, rel=1e-12)
    assert got["prefix_cache_device_blocks"] == 40.0
    assert got["router_index_accuracy"] == pytest.approx(0.96, rel=1e-12)
    stable = evaluate_signals(store.view(Scope("p1", "stable")), Scope("p1", "stable"), 10.0, 10.0, "scrape").values
    assert stable["prefix_cache_hit_rate"] == pytest.approx(0.6, rel=1e-12)
    assert stable["router_index_accuracy"] is None  # the router counts per pool, not per track


def test_prefix_cache_signals_without_lookups_are_no_data():
    store = SampleStore(retention_s=60)
    w0, e0 = worker("r0", "stable")
    for t in range(3):
        store.ingest(e0, generate_latest(w0.registry).decode(), float(t))
    got = evaluate_signals(store.view(Scope("p1")), Scope("p1"), 2.0, 10.0, "scrape").values
    assert (got["prefix_cache_hit_rate"], got["prefix_cache_device_blocks"], got["router_index_accuracy"]) == (
        None, None, None)


@pytest.mark.parametrize(
    ("name", "promql"),
    [
        ("prefix_cache_hit_rate", '(sum(rate(ferry_prefix_cache_hits_total{pool="decode"}[30s])) or vector(0)) / '
                                  'sum(rate(ferry_prefix_cache_queries_total{pool="decode"}[30s]))'),
        ("prefix_cache_device_blocks", 'sum(ferry_prefix_cache_blocks{pool="decode",group="full_attention"})'),
        ("router_index_accuracy",
         '(sum(rate(ferry_router_predicted_cached_tokens_total{pool="decode"}[30s])) or vector(0)) / '
         'sum(rate(ferry_router_reported_cached_tokens_total{pool="decode"}[30s]))'),
    ],
)
def test_prefix_cache_signals_render_promql(name, promql):
    assert SIGNAL_SPECS[name].promql(Scope("decode").matchers(), 30) == promql


def test_kv_transfer_breakdown_rates_by_direction_outcome_and_reason_and_its_promql(store):
    got = kv_transfer_breakdown(store.view(Scope("p1")), 0.0, 10.0)
    assert got == {  # r1 (canary) sends 4 transfers/s, one of them failing with "timeout", and 1000 wire bytes/s
        "transfers": [{"direction": "send", "outcome": "failure", "reason": "timeout", "per_s": pytest.approx(1.0)},
                      {"direction": "send", "outcome": "success", "reason": "none", "per_s": pytest.approx(3.0)}],
        "wire_bytes_per_s": {"send": pytest.approx(1000.0)}}
    # r0 (stable) never transferred: no series, empty lists (the page shows "none yet", not a made-up 0 rate).
    assert kv_transfer_breakdown(store.view(Scope("p1", "stable")), 0.0, 10.0) == {
        "transfers": [], "wire_bytes_per_s": {}}
    assert kv_transfer_breakdown_promql(Scope("p1").matchers(), 30.0) == (
        'sum by (direction, outcome, reason) (rate(ferry_kv_transfer_total{pool="p1"}[30s]))',
        'sum by (direction) (rate(ferry_kv_transfer_wire_bytes_total{pool="p1"}[30s]))')
