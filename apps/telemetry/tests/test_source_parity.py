"""Acceptance: one real worker under load, read through a real Prometheus and by direct scrape,
gives the same signals within stated tolerances.

Both sources evaluate the same instant and a window covering the whole load. Counter rates
agree to 10% (the two scrapers sample at different instants, so the extrapolation to the
window edges differs by up to one scrape interval over the sampled span; seen: within 2%);
ratios of counters to 0.01 absolute and histogram quantiles to 2% (the extrapolation factor
cancels out; seen: equal to 1e-15); gauges exactly, read once the exporter has been idle
longer than the worker's 5 s busy-ratio window. The synthetic case adds a router (its real
metrics registry): its decisions count for the pool their ``pool`` label names, in both sources.
"""

import collections
import importlib.util
import random
import threading
import time

import httpx
import pytest
from prometheus_client import start_http_server

from apps.telemetry.endpoints import ReplicaEndpoint, RouterEndpoint
from apps.telemetry.signals import SIGNAL_NAMES, Scope
from apps.telemetry.sources.prometheus import PrometheusSource
from apps.telemetry.sources.scrape import DirectScrapeSource
from apps.telemetry.tests.prometheus_process import PrometheusProcess, prometheus_available
from inference_worker.metrics import WorkerMetrics
from inference_worker.router.metrics import RouterMetrics
from inference_worker.tests.support.worker import WorkerProcess

pytestmark = pytest.mark.skipif(not prometheus_available(),
                                reason="needs Debian's prometheus: apt-get install -y prometheus")
WORKER_ENTRY_POINT = importlib.util.find_spec("inference_worker.__main__") is not None

REL_10 = ("rel", 0.10)
REL_2 = ("rel", 0.02)
EXACT = ("abs", 1e-9)
TOLERANCE = {
    "request_rate_per_s": REL_10, "prompt_tokens_per_s": REL_10, "generation_tokens_per_s": REL_10,
    "error_rate": ("abs", 0.01), "kv_transfer_failure_rate": ("abs", 0.01), "kv_transfer_bytes_per_s": REL_10,
    "ttft_p50_s": REL_2, "ttft_p95_s": REL_2, "ttft_p99_s": REL_2,
    "tpot_p50_s": REL_2, "tpot_p95_s": REL_2, "tpot_p99_s": REL_2,
    "num_requests_waiting": EXACT, "num_requests_running": EXACT, "kv_cache_usage": EXACT,
    "kv_cache_usage_max": EXACT, "engine_busy_ratio": EXACT, "gpu_utilization": EXACT,
    "ready_replicas": EXACT,
    "router_local_prefill_per_s": REL_10, "router_remote_prefill_per_s": REL_10,
    "router_local_prefill_fallback_per_s": REL_10,
    "router_ejections_per_s": REL_10, "router_ejected_replicas": EXACT,
    "prefix_cache_hit_rate": ("abs", 0.01), "prefix_cache_device_blocks": EXACT, "router_index_accuracy": ("abs", 0.01),
    # Histogram means and quantiles: ratios of rates, the extrapolation cancels.
    "request_sequences_per_s": REL_10, "request_prompt_tokens_mean": REL_2, "request_computed_prompt_tokens_mean": REL_2,
    "request_computed_prompt_tokens_p50": REL_2, "request_computed_prompt_tokens_p90": REL_2,
    "request_computed_prompt_tokens_p99": REL_2, "request_generation_tokens_mean": REL_2,
}
# Signals that must have data after the load (so the comparison cannot pass on two Nones).
MUST_HAVE_DATA = ("request_rate_per_s", "error_rate", "prompt_tokens_per_s", "generation_tokens_per_s",
                  "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "num_requests_waiting",
                  "kv_cache_usage", "engine_busy_ratio", "ready_replicas", "request_prompt_tokens_mean",
                  "request_computed_prompt_tokens_p50", "request_generation_tokens_mean")


@pytest.fixture(scope="module")
def worker():
    if not WORKER_ENTRY_POINT:
        pytest.skip("python -m inference_worker serve is not available yet")
    args = ["--pool", "parity", "--track", "stable", "--replica", "r0", "--role", "colocated",
            "--max-num-seqs", "4", "--fault-error-rate", "0.25", "--fault-seed", "3"]
    with WorkerProcess(*args) as proc:
        yield proc


@pytest.fixture(scope="module")
def endpoint(worker):
    return ReplicaEndpoint("parity", "stable", "r0", worker.base_url)


@pytest.fixture(scope="module")
def prometheus(endpoint):
    with PrometheusProcess([endpoint], interval_s=1.0) as prom:
        yield prom


@pytest.fixture
def synthetic():
    """A worker metrics registry (the real ``WorkerMetrics``) and a router's (``RouterMetrics``) over
    HTTP, without a model; the worker is pool id "7" of the pool named "synthetic"."""
    metrics = WorkerMetrics({"model": "gemma-3-270m", "role": "decode", "pool": "synthetic", "track": "stable",
                             "replica": "r0"})
    metrics.set_ready(True)
    router = RouterMetrics()
    servers = [start_http_server(0, addr="127.0.0.1", registry=r)[0] for r in (metrics.registry, router.registry)]
    endpoint = ReplicaEndpoint("7", "stable", "r0", f"http://127.0.0.1:{servers[0].server_address[1]}")
    router_endpoint = RouterEndpoint(f"http://127.0.0.1:{servers[1].server_address[1]}")
    with PrometheusProcess([endpoint], interval_s=1.0, routers=[router_endpoint]) as prom:
        yield metrics, router, [endpoint, router_endpoint], prom
    for server in servers:
        server.shutdown()
        server.server_close()


def send_load(base_url, num_threads=3, per_thread=5):
    statuses = []

    def client(i):
        with httpx.Client(base_url=base_url, timeout=300) as c:
            for j in range(per_thread):
                body = {"model": "gemma-3-270m", "prompt": f"Request {i}-{j}: the ferry crosses", "max_tokens": 8,
                        "temperature": 0.0, "ignore_eos": True}
                statuses.append(c.post("/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def compare(endpoints, prometheus_url, scopes, load):
    """Scrape ``endpoints`` directly every second while ``load()`` runs; return both sources' signals at
    one instant (``scopes``: the direct-scrape scope, then the Prometheus one)."""
    direct = DirectScrapeSource(retention_s=300)
    stop = threading.Event()

    def scrape_every_second():
        while not stop.is_set():
            direct.refresh(endpoints, time.time())
            stop.wait(1.0)

    scraper = threading.Thread(target=scrape_every_second, daemon=True)
    scraper.start()
    started = time.time()
    try:
        time.sleep(3)  # a few idle samples before the load in both stores
        load()
        # Idle long enough for the worker's busy ratio (a 5 s trailing window) to settle at 0 and for
        # both scrapers to have read that idle state.
        time.sleep(7)
        at = time.time()
        window = min(290, int(at - started) + 5)  # covers the whole load
        got_direct = direct.signals(scopes[0], window_s=window, at_s=at).values
        source = PrometheusSource(prometheus_url)
        got_prom = source.signals(scopes[1], window_s=window, at_s=at).values
        source.close()
    finally:
        stop.set()
        scraper.join(timeout=5)
        direct.close()
    return got_direct, got_prom


def assert_agree(got_direct, got_prom, must_have_data):
    assert set(got_direct) == set(got_prom) == set(SIGNAL_NAMES)
    for name in must_have_data:
        assert got_direct[name] is not None and got_prom[name] is not None, (name, got_direct[name], got_prom[name])
    mismatches = []
    for name in SIGNAL_NAMES:
        a, b = got_direct[name], got_prom[name]
        print(f"{name:28} direct={a!s:24} prometheus={b!s:24}")  # shown with pytest -s
        kind, tol = TOLERANCE[name]
        if a is None or b is None:
            ok = a is None and b is None
        elif kind == "rel":
            ok = abs(a - b) <= tol * max(abs(a), abs(b))
        else:
            ok = abs(a - b) <= tol
        if not ok:
            mismatches.append((name, a, b))
    assert not mismatches, f"direct vs prometheus: {mismatches}"


def test_prometheus_and_direct_scrape_agree_on_a_synthetic_exporter(synthetic):
    metrics, router, endpoints, prom = synthetic
    rng = random.Random(5)
    decisions = {d: router.decisions.labels(pool="synthetic", decision=d, track="stable")
                 for d in ("local_prefill", "remote_prefill", "local_prefill_fallback")}
    other_pool = router.decisions.labels(pool="elsewhere", decision="remote_prefill", track="stable")
    routed = collections.Counter()

    for outcome, reason in (("success", "none"), ("failure", "timeout")):  # series exist before the load,
        metrics.kv_transfer.transfers.labels(**metrics.identity, direction="send", outcome=outcome, reason=reason)
    metrics.kv_transfer.wire_bytes.labels(**metrics.identity, direction="send")  # as the worker's request series do

    def load():  # 8 s of traffic: ~10 requests/s, 10% server errors, KV transfers with failures
        for _ in range(80):
            metrics.request_finished("server_error" if rng.random() < 0.1 else "success")
            metrics.tokens(num_prompt_tokens=rng.randint(5, 50), num_generation_tokens=16)
            ttft = rng.uniform(0.02, 0.4)
            metrics.observe_latency(ttft_s=ttft, e2e_s=ttft + 15 * rng.uniform(0.01, 0.05), num_output_tokens=16)
            prompt = rng.randint(5, 3000)
            metrics.observe_lengths(num_prompt_tokens=prompt, num_cached_tokens=rng.randint(0, prompt - 1),
                                    num_output_tokens=16)
            outcome = "failure" if rng.random() < 0.2 else "success"
            metrics.kv_transfer.transfers.labels(**metrics.identity, direction="send", outcome=outcome,
                                                 reason="timeout" if outcome == "failure" else "none").inc()
            metrics.kv_transfer.wire_bytes.labels(**metrics.identity, direction="send").inc(rng.randint(100_000, 1_000_000))
            metrics.set_engine_state(num_waiting=rng.randint(0, 5), num_running=4, kv_cache_usage=rng.random(),
                                     busy_ratio=0.8)
            decision = rng.choice(("local_prefill", "local_prefill", "remote_prefill", "local_prefill_fallback"))
            decisions[decision].inc()
            routed[decision] += 1
            other_pool.inc(3)  # another pool's decisions: never this pool's
            time.sleep(0.1)
        metrics.set_engine_state(num_waiting=0, num_running=0, kv_cache_usage=0.125, busy_ratio=0.0)

    # Direct scrape selects the worker by its endpoint's pool id and router series by the pool's name;
    # Prometheus selects both by the pool label.
    got_direct, got_prom = compare(endpoints, prom.url, (Scope("7", label="synthetic"), Scope("synthetic")), load)
    assert_agree(got_direct, got_prom, (*MUST_HAVE_DATA, "kv_transfer_failure_rate", "kv_transfer_bytes_per_s",
                                        "router_local_prefill_per_s", "router_remote_prefill_per_s",
                                        "router_local_prefill_fallback_per_s"))
    assert got_direct["kv_cache_usage"] == 0.125 and got_direct["gpu_utilization"] is None
    # The decision series all start at 0 before the load and are sampled together, so one extrapolation
    # factor scales them all: the rates stand in the ratio of the decisions made.
    local = routed["local_prefill"] + routed["local_prefill_fallback"]
    assert got_direct["router_local_prefill_per_s"] / got_direct["router_remote_prefill_per_s"] == pytest.approx(
        local / routed["remote_prefill"], rel=1e-9)
    assert got_direct["router_local_prefill_fallback_per_s"] / got_direct["router_local_prefill_per_s"] == (
        pytest.approx(routed["local_prefill_fallback"] / local, rel=1e-9))


@pytest.mark.slow
def test_prometheus_and_direct_scrape_agree_on_one_worker_under_load(worker, endpoint, prometheus):
    statuses = []
    got_direct, got_prom = compare([endpoint], prometheus.url, (Scope("parity"), Scope("parity")),
                                   lambda: statuses.extend(send_load(worker.base_url)))
    assert 500 in statuses and 200 in statuses, statuses  # injected faults make a non-zero error rate
    assert_agree(got_direct, got_prom, MUST_HAVE_DATA)
    assert got_direct["error_rate"] > 0
