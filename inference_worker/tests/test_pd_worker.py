"""Prefill/decode disaggregation on real worker processes (Gemma 3 270M, CPU).

One prefill worker (``--fault-kv header``: each request may name a fault) and one decode worker
serve the whole module; both run with the per-request fault header test hook on
(``FERRY_TEST_KV_FAULT_HEADER=1``, see :mod:`inference_worker.server.pd_faults`). The colocated reference is the same decode worker without
``X-Ferry-Prefill-Endpoint`` (it then prefills locally), so both paths run the same weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference_worker import http_headers
from inference_worker.kv_transfer.layout import KVLayout, transfer_tokens
from inference_worker.kv_transfer.receiver import KVReceiver
from inference_worker.server.engine_stats import STATS_INTERVAL_S
from inference_worker.server.kv_cache_routes import RESET_PATH
from inference_worker.server.pd_faults import TEST_HEADER_ENV
from inference_worker.tests.support.router import RouterProcess, send_and_hold
from inference_worker.tests.support.worker import (
    REPO_ROOT,
    WorkerProcess,
    free_port,
    gemma_tokenizer_dir,
    start_together,
)
from inference_worker.tokenization import load_tokenizer

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
SECRET = "ferry-test-link-secret-0123456789"
COMMON = ("--kv-link-secret", SECRET, "--kv-cache-memory", "256MiB", "--max-num-seqs", "4", "--model-version", "v1")
TEXT = " ".join(f"Step {i}: the ferry leaves harbour {i % 7} carrying {3 * i + 1} crates of apples to the "
                f"island market." for i in range(400))
FAULT_HEADER_HOOK = {TEST_HEADER_ENV: "1"}
FAULT_REASONS = {"corrupt": "checksum", "truncate": "truncated", "wrong-key": "auth", "wrong-version": "version_mismatch"}


@pytest.fixture(scope="module")
def pd_pair():
    """The module's prefill and decode workers, started together (their start-ups overlap on two cores)."""
    pair = start_together(
        WorkerProcess("--role", "prefill", "--fault-kv", "header", *COMMON, env=FAULT_HEADER_HOOK),
        WorkerProcess("--role", "decode", "--kv-timeout", "120", "--max-prompts", "1000", *COMMON,
                      env=FAULT_HEADER_HOOK))
    try:
        yield pair
    finally:
        for worker in reversed(pair):
            worker.stop()


@pytest.fixture(scope="module")
def prefill(pd_pair):
    return pd_pair[0]


@pytest.fixture(scope="module")
def decode(pd_pair):
    return pd_pair[1]


@pytest.fixture(scope="module")
def tokens():
    ids = load_tokenizer(gemma_tokenizer_dir()).encode(TEXT, add_special_tokens=True).ids
    assert len(ids) > 3000
    return ids


def metrics(url: str) -> dict:
    """``(sample name, frozenset(non-identity labels)) -> value`` of a worker's /metrics."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            extra = frozenset((k, v) for k, v in s.labels.items()  # workers' identity labels are "" here
                              if k in ("direction", "outcome", "reason", "decision", "pool", "track") and v)
            out[(s.name, extra)] = out.get((s.name, extra), 0.0) + s.value
    return out


def transfers(url: str, direction: str, reason: str = "none") -> float:
    outcome = "success" if reason == "none" else "failure"
    key = frozenset({("direction", direction), ("outcome", outcome), ("reason", reason)})
    return metrics(url).get(("ferry_kv_transfer_total", key), 0.0)


def outcomes(url: str, outcome: str) -> float:
    """``ferry_requests_total{outcome}`` of a worker (a prefill worker counts its internal prefills)."""
    return metrics(url).get(("ferry_requests_total", frozenset({("outcome", outcome)})), 0.0)


def recomputes(url: str, reason: str) -> float:
    return metrics(url).get(("ferry_kv_recompute_total", frozenset({("reason", reason)})), 0.0)


PREFIX_HITS = ("ferry_prefix_cache_hits_total", frozenset())


def wait_metric(url: str, key: tuple, value: float, timeout_s: float = 10.0) -> float:
    """A worker's metric ``key`` once it equals ``value`` (engine counters are published periodically), or its
    last reading after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (got := metrics(url).get(key, 0.0)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def complete(url: str, prompt, *, max_tokens: int = 6, prefill_url: str | None = None, fault: str | None = None,
             expect: int = 200) -> dict:
    headers = {}
    if prefill_url:
        headers[http_headers.PREFILL_ENDPOINT] = prefill_url
    if fault:
        headers[http_headers.FAULT_KV] = fault
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=600)
    assert response.status_code == expect, response.text
    return response.json()


def wait_kv_free(*workers: WorkerProcess, timeout_s: float = 20.0) -> None:
    """Every worker's KV cache usage back to 0 (every block free), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        while True:
            usage = metrics(worker.base_url)[("ferry_kv_cache_usage_ratio", frozenset())]
            if usage == 0.0:
                break
            assert time.monotonic() < deadline, f"{worker.base_url}: KV cache usage stuck at {usage}"
            time.sleep(0.2)


def top2_gap(prompt_ids: list[int], generated: list[int], step: int) -> float:
    """Top-2 logit gap of the reference (in-process paged engine) at output ``step``."""
    import torch

    from inference_worker.engine.llm_engine import LLMEngine
    from inference_worker.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine.from_model(MODEL, kv_cache_memory="256MiB")
    engine.add_request("gap", prompt_ids + generated[:step], SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
        logits = engine.core.last_logits("gap")
        if logits is not None:
            top = torch.topk(logits, 2).values
            return float(top[0] - top[1])
    raise AssertionError("the reference engine produced no logits")


@pytest.mark.parametrize("num_tokens", [100, 511, 512, 513, 3000])
def test_prefill_decode_output_equals_colocated(prefill, decode, tokens, num_tokens):
    prompt = tokens[:num_tokens]
    layout = KVLayout.from_model_config(_gemma_config(), dtype="float32")
    received_before = metrics(decode.base_url)
    prefills_before = outcomes(prefill.base_url, "success")
    prompt_tokens = ("ferry_prompt_tokens_total", frozenset())
    prefill_tokens_before = metrics(prefill.base_url).get(prompt_tokens, 0.0)
    prefill_hits_before = metrics(prefill.base_url).get(PREFIX_HITS, 0.0)
    reference = complete(decode.base_url, prompt, max_tokens=8)
    decode_tokens_before = metrics(decode.base_url)[prompt_tokens]
    disaggregated = complete(decode.base_url, prompt, max_tokens=8, prefill_url=prefill.base_url)
    received_after = metrics(decode.base_url)
    assert outcomes(prefill.base_url, "success") == prefills_before + 1  # the prefill pool's requests count too
    # prompt tokens count where the prefill ran: on the prefill worker, not again on the decode worker
    assert received_after[prompt_tokens] == decode_tokens_before
    assert metrics(prefill.base_url)[prompt_tokens] == prefill_tokens_before + num_tokens
    ttft_count = ("ferry_time_to_first_token_seconds_count", frozenset())
    assert metrics(prefill.base_url)[ttft_count] == prefills_before + 1  # one TTFT per served prefill
    raw_key = ("ferry_kv_transfer_raw_bytes_total", frozenset({("direction", "receive")}))
    assert received_after[raw_key] - received_before.get(raw_key, 0.0) == layout.transfer_bytes(num_tokens)
    ref_text, got_text = reference["choices"][0]["text"], disaggregated["choices"][0]["text"]
    # the hand-off ships the whole prompt; cached_tokens is what the prefill worker's prefix cache spared it (the
    # previous cases' prefixes), whole 16-token blocks, the last prompt token computed
    cached = disaggregated["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert wait_metric(prefill.base_url, PREFIX_HITS, prefill_hits_before + cached) == prefill_hits_before + cached
    assert cached % 16 == 0 and cached < num_tokens
    assert {k: v for k, v in disaggregated["usage"].items() if k != "prompt_tokens_details"} == {
        k: v for k, v in reference["usage"].items() if k != "prompt_tokens_details"}
    if got_text != ref_text:  # allowed only where the reference's top-2 gap is below 1e-2
        tokenizer = load_tokenizer(gemma_tokenizer_dir())
        ref_ids = tokenizer.encode(ref_text, add_special_tokens=False).ids
        got_ids = tokenizer.encode(got_text, add_special_tokens=False).ids
        step = next(i for i, (a, b) in enumerate(zip(ref_ids, got_ids, strict=False)) if a != b)
        gap = top2_gap(prompt, ref_ids, step)
        print(f"N={num_tokens}: diverged at step {step} with reference top-2 gap {gap:.2e}")
        assert gap < 1e-2, (num_tokens, step, gap, ref_text, got_text)
    wait_kv_free(prefill, decode)


def test_remote_prefill_reports_the_prefill_workers_cache_hit(prefill, decode, tokens):
    """Regression: a remotely prefilled request reported ``cached_tokens`` 0 (and header 0) although the prefill
    worker reused its prefix cache. A 462-token prompt twice on a reset prefill worker: 0, then 448 (28 whole
    16-token blocks), in usage and header, streamed too; the decode worker computes and looks up nothing."""
    reset = b"{}"
    signature = hmac.new(SECRET.encode(), reset, hashlib.sha256).hexdigest()
    answer = httpx.post(prefill.base_url + RESET_PATH, content=reset, headers={http_headers.KV_SIGNATURE: signature})
    assert answer.status_code == 200, answer.text
    prompt, headers = tokens[:462], {http_headers.PREFILL_ENDPOINT: prefill.base_url}
    time.sleep(2 * STATS_INTERVAL_S)  # the counters of earlier requests are published by now
    decode_before, hits_before = metrics(decode.base_url), metrics(prefill.base_url).get(PREFIX_HITS, 0.0)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    first = httpx.post(decode.base_url + "/v1/completions", json=body, headers=headers, timeout=600)
    assert first.status_code == 200, first.text
    assert first.headers[http_headers.CACHED_TOKENS] == "0"
    assert first.json()["usage"] == {"prompt_tokens": 462, "completion_tokens": 2, "total_tokens": 464,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", decode.base_url + "/v1/completions", json=streamed, headers=headers,
                      timeout=600) as second:
        assert second.status_code == 200 and second.headers[http_headers.CACHED_TOKENS] == "448"
        chunks = [json.loads(line[6:]) for line in second.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"] == {"prompt_tokens": 462, "completion_tokens": 2, "total_tokens": 464,
                                   "prompt_tokens_details": {"cached_tokens": 448}}
    assert wait_metric(prefill.base_url, PREFIX_HITS, hits_before + 448) == hits_before + 448
    decode_after = metrics(decode.base_url)
    for key in (PREFIX_HITS, ("ferry_prefix_cache_queries_total", frozenset()),
                ("ferry_prompt_tokens_total", frozenset())):
        assert decode_after.get(key, 0.0) == decode_before.get(key, 0.0), key
    # ...but it answered both requests: its request-length histograms hold both whole prompts, and as computed
    # the 462 tokens of the first and the 14 the prefill worker's cache did not hold of the second
    for name, value in (("ferry_request_prompt_tokens_sum", 2 * 462), ("ferry_request_prompt_tokens_count", 2),
                        ("ferry_request_computed_prompt_tokens_sum", 462 + 14),
                        ("ferry_request_generation_tokens_sum", 4)):
        key = (name, frozenset())
        assert decode_after.get(key, 0.0) - decode_before.get(key, 0.0) == value, name
    wait_kv_free(prefill, decode)


def _gemma_config():
    from inference_worker.config import ModelConfig
    from inference_worker.registry import gguf_path

    return ModelConfig.from_gguf(gguf_path(MODEL))


def test_exact_bytes_per_layer_group(prefill, decode, tokens):
    """Call /internal/prefill with our own receiver: full layers get N tokens, sliding ones min(N, W-1)."""
    health = httpx.get(prefill.base_url + "/health").json()
    layout = KVLayout.from_model_config(_gemma_config(), dtype="float32")
    assert layout.kv_bytes_per_token == 2 * 1 * 256 * 4
    for n in (100, 600):
        payload, answer = asyncio.run(_prefill_into_own_receiver(prefill.base_url, tokens[:n], health))
        sent = {tuple(g["layers"]): g for g in answer["layer_groups"]}
        full = tuple(i for i, w in enumerate(layout.layer_windows) if w is None)
        sliding = tuple(i for i, w in enumerate(layout.layer_windows) if w is not None)
        assert full == (5, 11, 17) and len(sliding) == 15
        assert sent[full]["shape"] == [n, 1, 256] and sent[full]["first_position"] == 0
        assert sent[sliding]["shape"] == [min(n, 511), 1, 256]
        assert sent[sliding]["first_position"] == n - min(n, 511)
        assert answer["raw_bytes"] == 2048 * (3 * n + 15 * min(n, 511)) == layout.transfer_bytes(n)
        assert payload.raw_bytes == answer["raw_bytes"] and payload.wire_bytes == answer["wire_bytes"]
        for layer, (k, v) in enumerate(payload.layers):
            rows = transfer_tokens(n, layout.layer_windows[layer])
            assert tuple(k.shape) == tuple(v.shape) == (rows, 1, 256)
            assert k.abs().sum() > 0 and v.abs().sum() > 0
    wait_kv_free(prefill)


async def _prefill_into_own_receiver(prefill_url: str, prompt: list[int], health: dict):
    receiver = await KVReceiver(link_secret=SECRET.encode(), model_version_id=health["model_version_id"],
                                weights_sha256=health["weights_sha256"]).start()
    try:
        rid = f"bytes-{len(prompt)}"
        receiver.expect(rid)
        body = json.dumps({"request_id": rid, "prompt_token_ids": prompt, "sampling": {"temperature": 0.0},
                           "kv_host": "127.0.0.1", "kv_port": receiver.port, "model_version_id": "v1"}).encode()
        signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        async with httpx.AsyncClient(timeout=300) as client:
            unsigned = await client.post(prefill_url + "/internal/prefill", content=body)
            assert unsigned.status_code == 401
            response = await client.post(prefill_url + "/internal/prefill", content=body,
                                         headers={http_headers.KV_SIGNATURE: signature})
        assert response.status_code == 200, response.text
        return await receiver.wait(rid, 10.0), response.json()
    finally:
        await receiver.close()


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "wrong-key", "wrong-version"])
def test_bad_kv_is_rejected_counted_and_recomputed(prefill, decode, tokens, fault):
    prompt, reason = tokens[:40], FAULT_REASONS[fault]
    reference = complete(decode.base_url, prompt)["choices"][0]["text"]
    received, sent = transfers(decode.base_url, "receive", reason), transfers(prefill.base_url, "send", reason)
    recomputed = recomputes(decode.base_url, reason)
    failed_prefills = outcomes(prefill.base_url, "server_error")
    decode_tokens = metrics(decode.base_url)[("ferry_prompt_tokens_total", frozenset())]
    got = complete(decode.base_url, prompt, prefill_url=prefill.base_url, fault=fault)["choices"][0]["text"]
    assert got == reference
    assert outcomes(prefill.base_url, "server_error") == failed_prefills + 1  # its 502 is a failed prefill
    # the recompute prefilled the prompt on the decode worker: counted there
    assert metrics(decode.base_url)[("ferry_prompt_tokens_total", frozenset())] == decode_tokens + len(prompt)
    assert transfers(decode.base_url, "receive", reason) == received + 1
    assert transfers(prefill.base_url, "send", reason) == sent + 1
    assert recomputes(decode.base_url, reason) == recomputed + 1
    wait_kv_free(prefill, decode)
    ok = transfers(decode.base_url, "receive")
    assert complete(decode.base_url, prompt, prefill_url=prefill.base_url)["choices"][0]["text"] == reference
    assert transfers(decode.base_url, "receive") == ok + 1
    wait_kv_free(prefill, decode)


def test_unreachable_prefill_worker_is_recomputed(decode, tokens):
    prompt = tokens[:30]
    reference = complete(decode.base_url, prompt)["choices"][0]["text"]
    before = transfers(decode.base_url, "receive", "connection")
    nowhere = f"http://127.0.0.1:{free_port()}"
    assert complete(decode.base_url, prompt, prefill_url=nowhere)["choices"][0]["text"] == reference
    assert transfers(decode.base_url, "receive", "connection") == before + 1
    assert recomputes(decode.base_url, "connection") >= 1
    wait_kv_free(decode)


def test_prefill_killed_mid_send_hangs_nothing(prefill, decode, tokens):
    prompt = tokens[:300]
    reference = complete(decode.base_url, prompt)["choices"][0]["text"]
    before = transfers(decode.base_url, "receive", "truncated")
    with WorkerProcess("--role", "prefill", "--fault-kv", "die-mid-send", *COMMON) as dying:
        started = time.monotonic()
        got = complete(decode.base_url, prompt, prefill_url=dying.base_url)["choices"][0]["text"]
        assert got == reference
        assert dying.proc.wait(timeout=30) == -9
        assert time.monotonic() - started < 110  # well under the decode's 120 s KV timeout: nothing waited it out
    assert transfers(decode.base_url, "receive", "truncated") == before + 1
    wait_kv_free(decode)
    assert complete(decode.base_url, prompt, prefill_url=prefill.base_url)["choices"][0]["text"] == reference


def test_late_kv_with_recompute_off_is_a_clean_error(prefill, tokens):
    prompt = tokens[:40]
    with WorkerProcess("--role", "decode", "--kv-timeout", "3", "--kv-recompute-on-failure", "false",
                       *COMMON, env=FAULT_HEADER_HOOK) as strict:
        timeouts, late = transfers(strict.base_url, "receive", "timeout"), transfers(strict.base_url, "receive", "late")
        sent_late = transfers(prefill.base_url, "send", "late")
        started = time.monotonic()
        error = complete(strict.base_url, prompt, prefill_url=prefill.base_url, fault="delay:6", expect=502)["error"]
        assert time.monotonic() - started < 6
        assert error["code"] == "kv_transfer_failed" and "timeout" in error["message"]
        assert transfers(strict.base_url, "receive", "timeout") == timeouts + 1
        deadline = time.monotonic() + 30
        while transfers(strict.base_url, "receive", "late") == late and time.monotonic() < deadline:
            time.sleep(0.5)
        assert transfers(strict.base_url, "receive", "late") == late + 1
        assert transfers(prefill.base_url, "send", "late") == sent_late + 1
        error = complete(strict.base_url, prompt, prefill_url=prefill.base_url, fault="corrupt", expect=502)["error"]
        assert error["code"] == "kv_transfer_failed" and "checksum" in error["message"]
        wait_kv_free(prefill, strict)
        assert complete(strict.base_url, prompt, prefill_url=prefill.base_url)["choices"][0]["finish_reason"] == "length"
        assert metrics(strict.base_url).get(("ferry_kv_recompute_total", frozenset({("reason", "timeout")})), 0) == 0


def test_router_sends_a_long_prompt_prefill_to_decode(prefill, decode, tokens, tmp_path):
    tokenizer = load_tokenizer(gemma_tokenizer_dir())
    long_text = tokenizer.decode(tokens[1:200])
    short_text = "The ferry leaves"
    table = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
             "pools": [{"name": "decode-dc1", "role": "decode", "datacenter": "dc1",
                        "replicas": [{"name": "d0", "url": decode.base_url, "track": "stable"}]},
                       {"name": "prefill-dc2", "role": "prefill", "datacenter": "dc2",
                        "replicas": [{"name": "p0", "url": prefill.base_url, "track": "stable"}]}],
             "length_routing": {"threshold_tokens": 100}}
    (tmp_path / "table.json").write_text(json.dumps(table))
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "inference_worker", "router", "--port", str(port),
                               "--routing-table", str(tmp_path / "table.json"), "--tokenizer",
                               str(gemma_tokenizer_dir()), "--scrape-interval", "0", "--log-level", "warning", "--no-auth"],
                              cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, "router did not become ready"
            time.sleep(0.2)
        for text, decision, transferred in ((long_text, "remote_prefill", 1), (short_text, "local_prefill", 0)):
            reference = complete(decode.base_url, text)["choices"][0]["text"]
            before = transfers(decode.base_url, "receive")
            body = {"model": MODEL, "prompt": text, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            response = httpx.post(url + "/v1/completions", json=body, timeout=600)
            assert response.status_code == 200, response.text
            assert response.headers[http_headers.DECISION] == decision
            assert response.json()["choices"][0]["text"] == reference
            assert transfers(decode.base_url, "receive") == before + transferred
            key = ("ferry_router_decisions_total", frozenset({("pool", "decode-dc1"), ("decision", decision),
                                                                 ("track", "stable")}))
            assert metrics(url)[key] == 1
        wait_kv_free(prefill, decode)
    finally:
        router.terminate()
        router.wait(10)


RUNNING, WAITING = ("ferry_num_requests_running", frozenset()), ("ferry_num_requests_waiting", frozenset())
ABORTED = ("ferry_requests_total", frozenset({("outcome", "aborted")}))


def busy(url: str) -> bool:
    m = metrics(url)
    return m.get(RUNNING, 0.0) + m.get(WAITING, 0.0) > 0


def seconds_until_idle(url: str, timeout_s: float = 20.0) -> float:
    """Seconds until the worker's engine has nothing running or waiting (gauges published every 0.25 s)."""
    started = time.monotonic()
    while busy(url):
        assert time.monotonic() - started < timeout_s, f"{url} still busy {timeout_s}s after the client left"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def router(prefill, decode, tmp_path_factory):
    table = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
             "pools": [{"name": "decode-dc1", "role": "decode", "datacenter": "dc1",
                        "replicas": [{"name": "d0", "url": decode.base_url, "track": "stable"}]},
                       {"name": "prefill-dc2", "role": "prefill", "datacenter": "dc2",
                        "replicas": [{"name": "p0", "url": prefill.base_url, "track": "stable"}]}],
             "length_routing": {"threshold_tokens": 1000}}
    path = tmp_path_factory.mktemp("abort") / "table.json"
    path.write_text(json.dumps(table))
    router = RouterProcess(path, "--tokenizer", str(gemma_tokenizer_dir()), "--scrape-interval", "0",
                           "--max-prompts", "1000")
    yield router
    router.stop()


@pytest.mark.parametrize("via", ["worker", "router"])
def test_a_1000_prompt_batch_stops_when_its_client_leaves(decode, router, via):
    """The review's case: a 1000-prompt batch kept a worker busy 60 s after its client left. Now the engine
    aborts every sequence once the client hangs up, called directly or through the router."""
    url = decode.base_url if via == "worker" else router.url
    before = outcomes(decode.base_url, "aborted")
    body = {"model": MODEL, "prompt": [f"Crate {i} of the ferry holds" for i in range(1000)], "max_tokens": 64,
            "temperature": 0.0, "ignore_eos": True}
    sock = send_and_hold(url, "/v1/completions", body)
    deadline = time.monotonic() + 60
    while not metrics(decode.base_url).get(RUNNING, 0.0):
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.05)
    sock.close()
    seconds = seconds_until_idle(decode.base_url)
    assert outcomes(decode.base_url, "aborted") == before + 1
    wait_kv_free(decode)
    print(f"1000-prompt batch via {via}: engine idle {seconds:.2f}s after the client left")


def test_a_client_leaving_during_a_remote_prefill_aborts_it_on_the_prefill_worker(prefill, decode, router, tokens):
    """router -> decode -> prefill, streamed: the client hangs up while the prefill worker computes (a 2000-token
    prefill takes well over the 3 s waited here on CPU); the router cancels its request, the decode worker its
    hand-off, and the prefill worker aborts the prefill in its engine: counted as aborted, no KV ever sent."""
    before = outcomes(prefill.base_url, "aborted"), transfers(prefill.base_url, "send")
    prompt = tokens[:1] + [1000] + tokens[1:2000]  # a prompt of its own: no prefix-cache hit
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "stream": True}
    sock = send_and_hold(router.url, "/v1/completions", body)
    time.sleep(3.0)
    sock.close()
    assert wait_metric(prefill.base_url, ABORTED, before[0] + 1, timeout_s=60) == before[0] + 1
    seconds_until_idle(prefill.base_url, timeout_s=60)
    assert transfers(prefill.base_url, "send") == before[1]
    wait_kv_free(prefill, decode, timeout_s=60)
