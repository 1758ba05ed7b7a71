"""SIGTERM drain and the test-only fault option, each on its own real worker process.

The three workers are started together by one module fixture (their imports and weight loads overlap on
the 2-core machine instead of running one after another); each test still has a worker of its own.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from inference_worker.tests.support.worker import WorkerProcess, start_together

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
FAULT_RATE, FAULT_SEED = 0.3, 11


@pytest.fixture(scope="module")
def workers():
    """One worker per test: drain timeout 120 s, drain timeout 1 s, seeded fault injection."""
    started = dict(zip(("drain", "short_drain", "faults"), start_together(
        WorkerProcess("--drain-timeout", "120"),
        WorkerProcess("--drain-timeout", "1"),
        WorkerProcess("--fault-error-rate", str(FAULT_RATE), "--fault-seed", str(FAULT_SEED)),
    ), strict=True))
    yield started
    for worker in started.values():
        worker.stop()


def test_sigterm_during_four_streams_finishes_them_refuses_new_work_and_exits_0(workers):
    worker = workers["drain"]
    try:
        body = {"model": MODEL, "prompt": "The history of bridges", "max_tokens": 16, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        first_token = [threading.Event() for _ in range(4)]
        results: list[dict] = [{} for _ in range(4)]

        def run(i: int) -> None:
            text, usage, done = [], None, False
            with httpx.Client(base_url=worker.base_url, timeout=300) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            text.append(chunk["choices"][0]["text"])
                            first_token[i].set()
                        if chunk.get("usage"):
                            usage = chunk["usage"]
            results[i] = {"status": r.status_code, "text": "".join(text), "usage": usage, "done": done}

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        assert all(event.wait(300) for event in first_token)
        worker.terminate()
        # readiness turns false while the listener stays open and new work is refused with 503
        deadline = time.monotonic() + 10
        while httpx.get(worker.base_url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = httpx.post(worker.base_url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(300)
        assert worker.wait(60) == 0, worker.log_tail()
        for result in results:
            assert result["status"] == 200 and result["done"]
            assert result["usage"]["completion_tokens"] == 16
        assert len({r["text"] for r in results}) == 1  # same greedy text for all four
    finally:
        worker.stop()


def test_drain_timeout_aborts_a_long_request_cleanly_and_still_exits_0(workers):
    worker = workers["short_drain"]
    try:
        body = {"model": MODEL, "prompt": "Write a long story:", "max_tokens": 2000, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=worker.base_url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            stream = r.iter_lines()
            first = next(line for line in stream if line.startswith("data: {"))
            worker.terminate()
            started = time.monotonic()
            lines = [first, *(line for line in stream if line)]
        assert worker.wait(60) == 0, worker.log_tail()
        assert time.monotonic() - started < 30  # 1 s drain, not 2000 tokens
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "abort"
        assert "drain timeout: 1 request(s) still in flight are aborted" in worker.log_tail()
    finally:
        worker.stop()


def test_fault_error_rate_fails_the_seeded_fraction_with_openai_500s(workers):
    rate, seed, worker = FAULT_RATE, FAULT_SEED, workers["faults"]
    try:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0.0}
        statuses = []
        with httpx.Client(base_url=worker.base_url, timeout=120) as c:
            # invalid requests are still 400 and draw nothing from the fault RNG
            assert c.post("/v1/completions", json={**body, "max_tokens": 0}).status_code == 400
            for _ in range(12):
                response = c.post("/v1/completions", json=body)
                statuses.append(response.status_code)
                if response.status_code == 500:
                    error = response.json()["error"]
                    assert (error["type"], error["code"]) == ("server_error", "injected_fault")
    finally:
        worker.stop()
    rng = random.Random(seed)
    expected = [500 if rng.random() < rate else 200 for _ in range(12)]
    assert statuses == expected
    assert 0 < statuses.count(500) < 12
