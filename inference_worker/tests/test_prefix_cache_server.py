"""Prefix caching through the CLI (issue 16): two served Gemma 3 workers, one with ``--no-prefix-caching``
(the reference), one with prefix caching on (the default) and ``--block-size 7``.

Parity (acceptance 1 through the CLI): the prompts of ``test_prefix_cache_parity`` (resume points W-2,
W-1, W, W+1 and the prompt end) give the reference's greedy tokens; the in-process test shows no
top-2 near-tie on these prompts, so equality is exact. Also: ``usage.prompt_tokens_details.cached_tokens``
and ``X-Ferry-Cached-Tokens`` (non-streamed, and streamed where the header comes with the first byte
and the final chunk carries the usage), ``POST /admin/kv-cache/reset`` (401 unsigned, then clears),
``GET /v1/kv-events`` (snapshot, stored batches, resume after a sequence number, cleared), and the
``ferry_prefix_cache_*`` metrics. Both workers are started once for the module, side by side.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference_worker import http_headers
from inference_worker.server.kv_cache_routes import KV_EVENTS_PATH, RESET_PATH
from inference_worker.server.pd import sign
from inference_worker.tests.support.worker import WorkerProcess, start_together
from inference_worker.tests.test_prefix_cache_parity import RESUME_POINTS, L, make_prompts

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
SECRET = "prefix-cache-test-secret"
BS = 7
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def workers():
    common = ("--kv-cache-memory", "256MiB", "--kv-link-secret", SECRET)
    reference = WorkerProcess("--no-prefix-caching", *common)
    cached = WorkerProcess("--block-size", str(BS), *common)
    start_together(reference, cached)
    try:
        yield reference.base_url, cached.base_url
    finally:
        reference.stop()
        cached.stop()


@pytest.fixture(scope="module")
def prompts():
    p = make_prompts(300, 200_000)
    return p["resumed"] + [p["end"]], p["primer"]


def complete(url, prompt, **body):
    response = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response


def reset(url, body=b"{}", signature=None):
    signature = sign(SECRET.encode(), body) if signature is None else signature
    return httpx.post(url + RESET_PATH, content=body, headers={http_headers.KV_SIGNATURE: signature}, timeout=60)


def prefix_metrics(url):
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name.startswith(("ferry_prefix_cache", "ferry_kv_events")):
                out[(s.name, s.labels.get("group", ""))] = s.value
    return out


def test_cli_parity_cached_tokens_and_metrics(workers, prompts):
    reference_url, cached_url = workers
    tests, primer = prompts
    # the reference worker: one request with every prompt (batched), nothing cached even for a repeated prompt
    ref = complete(reference_url, tests).json()
    assert ref["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    ref_texts = [c["text"] for c in sorted(ref["choices"], key=lambda c: c["index"])]
    again = complete(reference_url, primer)
    assert again.headers[http_headers.CACHED_TOKENS] == "0"
    before = prefix_metrics(cached_url)
    first = complete(cached_url, primer)
    assert first.headers[http_headers.CACHED_TOKENS] == "0"
    expected_hits = [(r // BS) * BS for r in RESUME_POINTS] + [((L - 1) // BS) * BS]
    assert expected_hits == [504, 511, 511, 511, 525]  # 511 = 73 * 7
    for prompt, text, hit in zip(tests, ref_texts, expected_hits, strict=True):
        response = complete(cached_url, prompt)
        body = response.json()
        assert body["choices"][0]["text"] == text
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
        assert response.headers[http_headers.CACHED_TOKENS] == str(hit)
    after = prefix_metrics(cached_url)
    assert after[("ferry_prefix_cache_hits_total", "")] - before.get(("ferry_prefix_cache_hits_total", ""), 0) \
        == sum(expected_hits)
    assert after[("ferry_prefix_cache_queries_total", "")] - before.get(("ferry_prefix_cache_queries_total", ""), 0) \
        == L + sum(len(p) for p in tests)
    # the primer's 75 whole blocks (525 tokens) plus each resumed prompt's new whole blocks, in both groups
    assert after[("ferry_prefix_cache_blocks", "full_attention")] \
        == after[("ferry_prefix_cache_blocks", "sliding_attention")] >= L // BS
    assert after[("ferry_prefix_cache_evictions_total", "full_attention")] == 0


def test_streamed_header_and_final_usage_carry_the_hit(workers, prompts):
    _, cached_url = workers
    tests, primer = prompts
    complete(cached_url, primer)
    body = {"model": MODEL, "prompt": tests[2], "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cached_url + "/v1/completions", json=body, timeout=300) as response:
        assert response.headers[http_headers.CACHED_TOKENS] == "511"
        lines = [line for line in response.iter_lines() if line]
    usage = json.loads(lines[-2][len("data: "):])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 511} and usage["completion_tokens"] == MAX_TOKENS


def read_batches(url, after=None, num_batches=1):
    params = {} if after is None else {"after": after}
    batches = []
    with httpx.stream("GET", url + KV_EVENTS_PATH, params=params, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
        for line in response.iter_lines():
            if line:
                batches.append(json.loads(line))
            if len(batches) == num_batches:
                break
    return batches


def test_reset_is_signed_and_kv_events_stream_snapshots_stores_and_clears(workers, prompts):
    _, cached_url = workers
    tests, primer = prompts
    assert reset(cached_url, signature="").status_code == 401
    assert reset(cached_url, signature=sign(b"another-secret-of-16+", b"{}")).status_code == 401
    assert reset(cached_url).status_code == 200
    snapshot = read_batches(cached_url)[0]
    assert snapshot["snapshot"] is True and snapshot["events"] == [{"type": "cleared"}]
    seq = snapshot["seq"]
    complete(cached_url, tests[0][:3 * BS + 2])  # 23 tokens: 3 whole blocks, stored in both groups
    batch = read_batches(cached_url, after=seq)[0]
    assert batch["snapshot"] is False and batch["worker_id"] == snapshot["worker_id"]
    stored = batch["events"]
    assert batch["seq"] == seq + 6 and [e["type"] for e in stored] == ["stored"] * 6
    assert [e["group"] for e in stored] == ["full_attention"] * 3 + ["sliding_attention"] * 3
    assert stored[1]["parent"] == stored[0]["digest"] and stored[4]["parent"] == stored[3]["digest"]
    assert {e["tier"] for e in stored} == {"device"}
    # a client that is ahead of the worker (e.g. after a restart) gets a snapshot of the 6 blocks
    ahead = read_batches(cached_url, after=10**9)[0]
    assert ahead["snapshot"] and ahead["seq"] == seq + 6
    assert ahead["events"][0] == {"type": "cleared"} and sorted(e["digest"] for e in ahead["events"][1:]) == \
        sorted(e["digest"] for e in stored)
    assert reset(cached_url).json() == {"cleared_blocks": 6}
    assert read_batches(cached_url, after=seq + 6)[0]["events"] == [{"type": "cleared"}]
    assert httpx.get(cached_url + KV_EVENTS_PATH, params={"after": "x"}, timeout=10).status_code == 400
    time.sleep(0.5)  # the engine thread publishes metrics every 0.25 s
    counters = prefix_metrics(cached_url)
    assert counters[("ferry_kv_events_total", "")] >= seq + 7  # every event since start, numbered 1..seq+7
    assert counters[("ferry_kv_events_sent_total", "")] >= 6 + 7 + 1  # the batches read above, at least
    assert counters[("ferry_kv_events_sent_bytes_total", "")] > 0
