"""The profiling sweep against a mock worker (httpx.MockTransport): fresh prompts per sweep, cache hits refused,
co-located prefill measured while a stream decodes."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from apps.planning.profiling import SweepError, WorkerSweep
from inference_worker import http_headers


class MockWorker:
    """``/v1/models`` and ``/v1/completions`` of a worker whose prefix cache holds every prompt it has seen."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, ...]] = set()
        self.prompts: list[list[int]] = []
        self.unmarked: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get(http_headers.PROFILING) is None:  # would count as the pool's traffic
            self.unmarked.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        body = json.loads(request.content)
        prompt = tuple(body["prompt"])
        if body.get("stream"):
            time.sleep(0.02)  # a stream takes a while (the co-located measurement's background one would spin)
            chunks = "".join(f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n' for i in range(body["max_tokens"]))
            return httpx.Response(200, text=chunks + "data: [DONE]\n\n")
        with self.lock:
            hit = len(prompt) if prompt in self.seen else 0
            self.seen.add(prompt)
            self.prompts.append(list(prompt))
        return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": hit}}})


def test_two_sweeps_of_one_worker_send_different_prompts_and_a_cache_hit_fails_the_sweep():
    worker = MockWorker()
    transport = httpx.MockTransport(worker)
    for _ in range(2):  # the default seed comes from the OS: the second sweep's prompts are new, no hit
        sweep = WorkerSweep("http://worker", "token", vocab_size=50_000, transport=transport)
        found = sweep.run(lengths=[16, 32, 64], batch_sizes=[1, 2], max_new_tokens=6)
        assert [n for n, _ in found.prefill_points] == [16, 32, 64]
    assert len(worker.prompts) == 2 * 3 * 2 and len(worker.seen) == 12
    assert worker.unmarked == []  # every request says it is profiling (the worker keeps it out of traffic lengths)
    # A fixed seed repeats the first sweep's prompts: the worker reports the hit and the sweep refuses the point.
    with pytest.raises(SweepError, match="prefix cache held 16 of the 16 random prompt tokens"):
        for _ in range(2):
            WorkerSweep("http://worker", "token", vocab_size=50_000, seed=7, transport=transport).run(
                lengths=[16, 32, 64], batch_sizes=[1, 2], max_new_tokens=6)


def test_colocated_points_are_measured_per_length_while_a_stream_runs():
    worker = MockWorker()
    sweep = WorkerSweep("http://worker", "token", vocab_size=50_000, transport=httpx.MockTransport(worker))
    found = sweep.run(lengths=[16, 32, 64], batch_sizes=[1, 2], max_new_tokens=6, colocated=True)
    assert [n for n, _ in found.colocated_prefill_points] == [16, 32, 64]
    assert all(s > 0 for _, s in found.colocated_prefill_points)
    # 2 idle repeats and 4 co-located ones per length, every prompt new.
    assert len(worker.prompts) == 3 * (2 + 4) == len(worker.seen)
    assert worker.unmarked == []  # the streams and the model card too
