"""Worker /metrics on a real process (max_num_seqs=1): contract, counters, queue depth, disconnect abort."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference_worker import http_headers
from inference_worker.tests.support.worker import WorkerProcess, gemma_tokenizer_dir
from inference_worker.tokenization import load_tokenizer

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
LABELS = {"model": MODEL, "model_version": "v7", "role": "decode", "pool": "p1", "track": "canary",
          "replica": "r0"}


@pytest.fixture(scope="module")
def worker():
    args = ["--max-num-seqs", "1", "--role", "decode", "--pool", "p1", "--track", "canary", "--replica", "r0",
            "--model-version", "v7"]
    with WorkerProcess(*args) as proc:
        yield proc


@pytest.fixture(scope="module")
def api(worker):
    with httpx.Client(base_url=worker.base_url, timeout=300) as c:
        yield c


def scrape(api) -> dict[tuple[str, tuple], float]:
    """All samples keyed by (name, sorted extra labels beyond the identity labels)."""
    response = api.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            identity = {k: v for k, v in sample.labels.items() if k in LABELS}
            assert identity == LABELS, sample
            extra = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in LABELS))
            samples[(sample.name, extra)] = sample.value
    return samples


def test_metrics_follow_the_contract(api):
    text = api.get("/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    expected = {
        "ferry_num_requests_waiting": "gauge", "ferry_num_requests_running": "gauge",
        "ferry_requests": "counter", "ferry_prompt_tokens": "counter", "ferry_generation_tokens": "counter",
        "ferry_time_to_first_token_seconds": "histogram", "ferry_time_per_output_token_seconds": "histogram",
        "ferry_e2e_request_latency_seconds": "histogram", "ferry_kv_cache_usage_ratio": "gauge",
        "ferry_engine_busy_ratio": "gauge", "ferry_worker_ready": "gauge",
        # KV transfer series are defined (HELP/TYPE) before the disaggregation work increments them
        "ferry_kv_transfer": "counter", "ferry_kv_transfer_raw_bytes": "counter",
        "ferry_kv_transfer_wire_bytes": "counter", "ferry_kv_transfer_seconds": "histogram",
        "ferry_request_prompt_tokens": "histogram", "ferry_request_computed_prompt_tokens": "histogram",
        "ferry_request_generation_tokens": "histogram",
    }
    assert {name: families.get(name) for name in expected} == expected
    assert all(name.startswith("ferry_") for name in families)
    # no GPU on this machine: no GPU figures at all, rather than made-up ones
    assert not any(name.startswith("ferry_gpu_") for name in families)
    samples = scrape(api)
    assert samples[("ferry_worker_ready", ())] == 1.0
    assert {extra for name, extra in samples if name == "ferry_requests_total"} == {
        (("outcome", o),) for o in ("success", "client_error", "server_error", "aborted", "rejected")
    }


def test_counters_move_with_requests(api):
    tokenizer = load_tokenizer(gemma_tokenizer_dir())
    prompt = "Counting tokens is"
    num_prompt = len(tokenizer.encode(prompt, add_special_tokens=True).ids)
    before = scrape(api)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    assert api.post("/v1/completions", json=body).status_code == 200
    assert api.post("/v1/completions", json={**body, "max_tokens": -3}).status_code == 400
    after = scrape(api)

    def delta(name, *extra):
        return after[(name, extra)] - before[(name, extra)]

    assert delta("ferry_requests_total", ("outcome", "success")) == 1
    assert delta("ferry_requests_total", ("outcome", "client_error")) == 1
    assert delta("ferry_prompt_tokens_total") == num_prompt
    assert delta("ferry_generation_tokens_total") == 5
    assert delta("ferry_time_to_first_token_seconds_count") == 1
    assert delta("ferry_time_per_output_token_seconds_count") == 1
    assert delta("ferry_e2e_request_latency_seconds_count") == 1
    assert delta("ferry_request_prompt_tokens_count") == delta("ferry_request_generation_tokens_count") == 1
    assert delta("ferry_request_prompt_tokens_sum") == num_prompt
    assert delta("ferry_request_generation_tokens_sum") == 5
    # the histogram's buckets hold the observation: 5 generated tokens are in le=6 but not le=4
    assert delta("ferry_request_generation_tokens_bucket", ("le", "6.0")) == 1
    assert delta("ferry_request_generation_tokens_bucket", ("le", "4.0")) == 0


def test_a_profiling_request_is_served_but_left_out_of_the_request_lengths(api):
    """The planner reads the request-length histograms as the pool's traffic, and the latency histograms are the
    clients' latency: a profiling sweep's requests (header ``x-ferry-profiling``) are counted as requests and
    tokens, not in those histograms."""
    body = {"model": MODEL, "prompt": "A sweep measures the prefill", "max_tokens": 1, "temperature": 0.0}
    before = scrape(api)
    answer = api.post("/v1/completions", json=body, headers={http_headers.PROFILING: "1"})
    after = scrape(api)
    assert answer.status_code == 200
    assert after[("ferry_requests_total", (("outcome", "success"),))] \
        - before[("ferry_requests_total", (("outcome", "success"),))] == 1
    assert after[("ferry_prompt_tokens_total", ())] > before[("ferry_prompt_tokens_total", ())]
    for name in ("ferry_request_prompt_tokens_count", "ferry_request_computed_prompt_tokens_count",
                 "ferry_request_generation_tokens_count", "ferry_time_to_first_token_seconds_count",
                 "ferry_e2e_request_latency_seconds_count"):
        assert after[(name, ())] == before[(name, ())], name


def test_request_lengths_count_the_prefix_cache_hit_as_not_computed(api):
    """A repeated prompt finds its full blocks cached: the computed-prompt histogram records the prompt minus the
    ``cached_tokens`` the answer reports, the prompt histogram the whole prompt."""
    body = {"model": MODEL, "prompt": "The planner reads request lengths from histograms. " * 8, "max_tokens": 2,
            "temperature": 0.0, "ignore_eos": True}
    first = api.post("/v1/completions", json=body).json()["usage"]
    before = scrape(api)
    second = api.post("/v1/completions", json=body).json()["usage"]
    after = scrape(api)
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"] and 0 < cached < second["prompt_tokens"]
    assert after[("ferry_request_prompt_tokens_sum", ())] - before[("ferry_request_prompt_tokens_sum", ())] \
        == second["prompt_tokens"]
    assert after[("ferry_request_computed_prompt_tokens_sum", ())] \
        - before[("ferry_request_computed_prompt_tokens_sum", ())] == second["prompt_tokens"] - cached


def test_queue_depth_is_non_zero_while_more_requests_wait_than_the_batch_admits(api, worker):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    statuses = []

    def send():
        with httpx.Client(base_url=worker.base_url, timeout=300) as c:
            statuses.append(c.post("/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    max_waiting = max_running = 0.0
    while any(t.is_alive() for t in threads):
        samples = scrape(api)
        max_waiting = max(max_waiting, samples[("ferry_num_requests_waiting", ())])
        max_running = max(max_running, samples[("ferry_num_requests_running", ())])
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert statuses == [200, 200, 200]
    assert max_running == 1  # --max-num-seqs 1
    assert max_waiting == 2  # the other two wait their turn
    time.sleep(0.6)  # gauges are published every 0.25 s
    idle = scrape(api)
    assert idle[("ferry_num_requests_waiting", ())] == 0 and idle[("ferry_num_requests_running", ())] == 0


def test_client_disconnect_mid_stream_aborts_the_request_and_frees_its_kv(api, worker):
    before = scrape(api)
    body = {"model": MODEL, "prompt": "Write a long story:", "max_tokens": 400, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=worker.base_url, timeout=300) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # got a token: hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = scrape(api)
        if after[("ferry_requests_total", (("outcome", "aborted"),))] > before[
            ("ferry_requests_total", (("outcome", "aborted"),))
        ] and after[("ferry_num_requests_running", ())] == 0:
            break
        time.sleep(0.1)
    assert after[("ferry_requests_total", (("outcome", "aborted"),))] - before[
        ("ferry_requests_total", (("outcome", "aborted"),))
    ] == 1
    assert after[("ferry_num_requests_running", ())] == 0
    assert after[("ferry_kv_cache_usage_ratio", ())] == 0.0
    # far fewer than 400 tokens were generated: the engine stopped when the api left
    assert after[("ferry_generation_tokens_total", ())] - before[("ferry_generation_tokens_total", ())] < 400


def test_client_disconnect_while_waiting_for_a_non_streamed_response_aborts_it(api, worker):
    aborted = ("ferry_requests_total", (("outcome", "aborted"),))
    before = scrape(api)
    body = {"model": MODEL, "prompt": "Write a long story:", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=worker.base_url, timeout=3) as c:
        c.post("/v1/completions", json=body)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = scrape(api)
        if after[aborted] > before[aborted] and after[("ferry_num_requests_running", ())] == 0:
            break
        time.sleep(0.1)
    assert after[aborted] - before[aborted] == 1
    assert after[("ferry_num_requests_running", ())] == 0
    assert after[("ferry_generation_tokens_total", ())] - before[("ferry_generation_tokens_total", ())] < 400
