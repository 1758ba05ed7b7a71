"""Pools that run vLLM or SGLang: Ferry's signals computed from the engines' own ``/metrics`` pages.

The pages are written from the engines' documented names, types, labels and default buckets
(:mod:`apps.telemetry.tests.engine_exporters`). Two scrapes 10 s apart; every expected value is worked out by hand
below (Prometheus' ``rate`` over a window the two samples span exactly, and ``histogram_quantile``'s linear
interpolation inside the bucket holding the rank). The same pages read through a real Prometheus with the generated
``metric_relabel_configs`` give the same signals, and a canary gate on TTFT p99 evaluates on a vLLM pool.
"""

import time

import pytest
from prometheus_client import generate_latest

from apps.telemetry.endpoints import (
    ReplicaEndpoint,
    prometheus_engine_scrape_configs,
    prometheus_scrape_config,
)
from apps.telemetry.signals import SIGNAL_NAMES, Scope, evaluate_signals
from apps.telemetry.sources.prometheus import PrometheusSource
from apps.telemetry.sources.scrape import SampleStore
from apps.telemetry.tests.engine_exporters import SglangExporter, VllmExporter, serve_text_format
from apps.telemetry.tests.prometheus_process import PrometheusProcess, prometheus_available


def vllm_load(e: VllmExporter) -> None:
    """What happened between the two scrapes on the vLLM replica."""
    e.waiting.set(3)
    e.running.set(2)
    e.kv_usage.set(0.25)
    e.prompt_tokens.inc(1000)
    e.generation_tokens.inc(300)
    e.prefix_queries.inc(1000)
    e.prefix_hits.inc(400)
    e.success["stop"].inc(6)
    e.success["length"].inc(2)
    e.success["abort"].inc(1)
    for _ in range(7):
        e.ttft.observe(0.05)  # bucket (0.04, 0.06]
    for _ in range(2):
        e.ttft.observe(0.3)  # bucket (0.25, 0.5]
    for _ in range(8):
        e.tpot.observe(0.02)  # bucket (0.01, 0.025]
    e.itl.observe(5.0)  # per-token latency: not Ferry's TPOT, must not count
    for _ in range(8):
        e.e2e.observe(0.9)
    for prompt, generation in ((100, 30), (100, 30), (300, 40), (500, 200)):
        e.prompt_lengths.observe(prompt)
        e.generation_lengths.observe(generation)


# Per load (5 s): 9 finished requests, 1000 prompt tokens, 300 generated; 400 of 1000 looked-up tokens cached.
VLLM_EXPECTED = {
    "request_rate_per_s": 1.8,
    "error_rate": None,  # this vLLM has no "error" finish reason: no failure series, so no data (never 0)
    "num_requests_waiting": 3.0,
    "num_requests_running": 2.0,
    "kv_cache_usage": 0.25,
    "kv_cache_usage_max": 0.25,
    # TTFT: 7 in (0.04, 0.06], 2 in (0.25, 0.5]. p50 rank 4.5: 0.04 + 0.02 * 4.5/7; p99 rank 8.91: 0.25 + 0.25 * 1.91/2.
    "ttft_p50_s": 0.04 + 0.02 * 4.5 / 7,
    "ttft_p99_s": 0.25 + 0.25 * 1.91 / 2,
    # TPOT (per request): 8 in (0.01, 0.025]. p50 rank 4: 0.01 + 0.015 * 4/8.
    "tpot_p50_s": 0.01 + 0.015 * 4 / 8,
    "prompt_tokens_per_s": 200.0,
    "generation_tokens_per_s": 60.0,
    "prefix_cache_hit_rate": 0.4,
    "ready_replicas": 1.0,  # answers its /metrics and has no readiness gauge
    "kv_transfer_failure_rate": None,  # Ferry's own KV transfer: not in a vLLM pool
    "engine_busy_ratio": None,
    # Request lengths: 4 requests of 1000 prompt tokens and 300 generated. vLLM has no computed-prompt (not cached)
    # histogram: no data.
    "request_prompt_tokens_mean": 250.0,
    "request_sequences_per_s": 0.8,  # 4 requests per 5 s
    "request_generation_tokens_mean": 75.0,
    "request_computed_prompt_tokens_mean": None,
    "request_computed_prompt_tokens_p90": None,
}


def sglang_load(e: SglangExporter) -> None:
    e.queue.set(4)
    e.running.set(1)
    e.token_usage.set(0.5)
    e.gen_throughput.set(123.0)
    e.prompt_tokens.inc(2000)
    e.generation_tokens.inc(500)
    e.cached_tokens.inc(800)
    e.requests.inc(5)
    e.aborted.inc(1)
    for ttft in (0.15, 0.15, 0.15, 0.7, 3.0):  # buckets (0.1, 0.2], (0.6, 0.8], (2, 4]
        e.ttft.observe(ttft)
    for _ in range(10):
        e.itl.observe(0.012)  # bucket (0.010, 0.015]
    for _ in range(5):
        e.e2e.observe(1.5)


SGLANG_EXPECTED = {
    "request_rate_per_s": 1.0,  # sglang:num_requests_total counts every finished request (5 per 5 s)
    "error_rate": None,  # SGLang has no server-error counter
    "num_requests_waiting": 4.0,
    "num_requests_running": 1.0,
    "kv_cache_usage": 0.5,
    # TTFT: 3 in (0.1, 0.2], 1 in (0.6, 0.8], 1 in (2, 4]. p50 rank 2.5: 0.1 + 0.1 * 2.5/3; p99 rank 4.95: 2 + 2 * 0.95.
    "ttft_p50_s": 0.1 + 0.1 * 2.5 / 3,
    "ttft_p99_s": 2.0 + 2.0 * 0.95,
    # SGLang's TPOT is its inter-token latency: 10 in (0.010, 0.015]; p50 rank 5: 0.010 + 0.005 * 5/10.
    "tpot_p50_s": 0.010 + 0.005 * 5 / 10,
    "prompt_tokens_per_s": 400.0,
    "generation_tokens_per_s": 100.0,
    "prefix_cache_hit_rate": None,  # cached tokens are exported, lookups are not (module docstring)
    "ready_replicas": 1.0,
    "request_prompt_tokens_mean": None,  # no request-length histograms
    "request_sequences_per_s": None,
    "request_generation_tokens_mean": None,
}


def three_scrapes(engine: str, exporter, load) -> SampleStore:
    """Scrapes at t = 100 (idle), 105 and 110 s, ``load`` applied before each of the last two: over the window
    (100, 110] Prometheus' ``rate`` reads the one 5 s interval inside it, extrapolated to the window start (the
    gap is under 1.1 intervals), so every rate is one ``load`` per 5 s and every quantile that of one ``load``."""
    store = SampleStore(retention_s=60)
    endpoint = ReplicaEndpoint("7", "stable", "r0", "http://10.0.0.5:8000", engine=engine, pool_name="chat")
    store.ingest(endpoint, generate_latest(exporter.registry).decode(), 100.0)
    for at in (105.0, 110.0):
        load(exporter)
        store.ingest(endpoint, generate_latest(exporter.registry).decode(), at)
    return store


@pytest.mark.parametrize(("engine", "exporter", "load", "expected"), [
    ("vllm", VllmExporter, vllm_load, VLLM_EXPECTED),
    ("sglang", SglangExporter, sglang_load, SGLANG_EXPECTED),
])
def test_signals_from_an_engines_metrics_page_equal_the_hand_computed_values(engine, exporter, load, expected):
    store = three_scrapes(engine, exporter(), load)
    scope = Scope("7", label="chat", engine=engine)
    got = evaluate_signals(store.view(scope), scope, 110.0, 10.0, "scrape").values
    assert set(got) == set(SIGNAL_NAMES)
    for name, value in expected.items():
        assert got[name] == (None if value is None else pytest.approx(value, rel=1e-9)), name


def test_a_ferry_endpoint_keeps_the_engine_names_out():
    """The same vLLM page scraped as a Ferry worker's gives no Ferry signal: translation is per engine kind."""
    store = three_scrapes("ferry", VllmExporter(), vllm_load)
    scope = Scope("7", label="chat")
    got = evaluate_signals(store.view(scope), scope, 110.0, 10.0, "scrape").values
    assert got["num_requests_waiting"] is None and got["ttft_p99_s"] is None and got["request_rate_per_s"] is None


@pytest.mark.skipif(not prometheus_available(), reason="needs Debian's prometheus: apt-get install -y prometheus")
def test_prometheus_with_the_generated_relabel_rules_reads_a_vllm_pool_like_direct_scrape():
    exporter = VllmExporter()
    server = serve_text_format(exporter.registry)
    endpoint = ReplicaEndpoint("7", "stable", "r0", f"http://127.0.0.1:{server.server_address[1]}", engine="vllm",
                               pool_name="chat")
    assert prometheus_scrape_config([endpoint])["static_configs"] == []  # not in the Ferry workers' job
    try:
        with PrometheusProcess([endpoint], interval_s=0.5) as prom:
            started = time.time()
            time.sleep(2)
            vllm_load(exporter)
            time.sleep(3)
            at = time.time()
            source = PrometheusSource(prom.url)
            try:
                got = source.signals(Scope("chat", engine="vllm"), window_s=round(at - started) + 2, at_s=at).values
            finally:
                source.close()
    finally:
        server.shutdown()
        server.server_close()
    # Ratios and quantiles cancel Prometheus' extrapolation to the window edges: exact as by hand.
    for name in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "prefix_cache_hit_rate", "num_requests_waiting",
                 "num_requests_running", "kv_cache_usage", "request_prompt_tokens_mean",
                 "request_generation_tokens_mean"):
        assert got[name] == pytest.approx(VLLM_EXPECTED[name], rel=1e-9), name
    assert got["error_rate"] is None
    assert got["request_rate_per_s"] > 0  # 9 requests over the window (its length depends on scrape timing)


def test_engine_scrape_jobs_set_the_pool_labels_and_rename_series():
    endpoints = [ReplicaEndpoint("7", "stable", "r0", "http://10.0.0.5:8000", engine="vllm", pool_name="chat"),
                 ReplicaEndpoint("8", "canary", "r1", "http://10.0.0.6:8000", engine="sglang", pool_name="agents"),
                 ReplicaEndpoint("9", "stable", "r2", "http://10.0.0.7:8000")]
    jobs = prometheus_engine_scrape_configs(endpoints, interval_s=1.0)
    assert [job["job_name"] for job in jobs] == ["ferry-sglang", "ferry-vllm"]
    assert jobs[1]["static_configs"] == [{"targets": ["10.0.0.5:8000"], "labels": {
        "pool": "chat", "pool_id": "7", "track": "stable", "replica": "r0"}}]
    assert "honor_labels" not in jobs[1]  # the engine's series carry no pool label of their own
    with pytest.raises(ValueError, match="no pool name"):
        prometheus_engine_scrape_configs([ReplicaEndpoint("7", "stable", "r0", "http://10.0.0.5:8000", engine="vllm")])
