"""Request bounds shared by router and worker (:mod:`inference_worker.request_limits`) and the worker's use of
them: every malformed or oversized body of the security review is a 400/413 naming the problem, never a 500,
and tokenization lets other threads (the event loop) run.

The worker is tested in-process with an engine loop that fails any use, so a request that got past the checks
would be a 500.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from inference_worker.metrics import WorkerMetrics
from inference_worker.request_limits import (
    MAX_JSON_DEPTH,
    check_request_size,
    default_max_body_bytes,
    parse_json_body,
)
from inference_worker.router.prompt import PromptCounter
from inference_worker.server.app import create_app
from inference_worker.server.errors import OpenAIError
from inference_worker.server.state import ServedModel, ServerState
from inference_worker.tests.support.worker import gemma_tokenizer_dir

MAX_MODEL_LEN = 4096
BAD_BODIES = {  # the review's malformed inputs and their kin: (raw body, param named or None)
    "lone_surrogate": (b'{"model": "m", "prompt": "\\ud800"}', None),
    "deep_nesting": (b'{"model": "m", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", None),
    "temperature_infinity": (b'{"model": "m", "prompt": "hi", "temperature": Infinity}', "temperature"),
    "temperature_nan": (b'{"model": "m", "prompt": "hi", "temperature": NaN}', "temperature"),
    "temperature_overflow": (b'{"model": "m", "prompt": "hi", "temperature": 1e400}', "temperature"),
    "top_p_minus_infinity": (b'{"model": "m", "prompt": "hi", "top_p": -Infinity}', "top_p"),
    "n_over_limit": (b'{"model": "m", "prompt": "hi", "n": 17}', "n"),
    "batch_over_limit": (json.dumps({"model": "m", "prompt": ["hi"] * 65}).encode(), "prompt"),
    "invalid_utf8": (b'{"model": "m", "prompt": "\xff\xfe"}', None),
}


@pytest.fixture()
def worker():
    registry = CollectorRegistry()
    model = ServedModel(engine_loop=SimpleNamespace(alive=True), tokenizer=None, chat_template=None,
                        max_model_len=MAX_MODEL_LEN, vocab_size=1000, make_sampling_params=dict)
    state = ServerState(served_model_name="m", metrics=WorkerMetrics({"model": "m", "role": "colocated"}, registry),
                        model=model)
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        yield client, state


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_worker_answers_400_for_every_malformed_body(worker, case):
    client, _ = worker
    raw, param = BAD_BODIES[case]
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_parse_and_size_checks_refuse_every_malformed_body_with_400(case):
    """The router's checks (the same module): parse, then size limits."""
    raw, _ = BAD_BODIES[case]
    with pytest.raises(OpenAIError) as exc:
        check_request_size(parse_json_body(raw))
    assert exc.value.status_code == 400


def test_nesting_limit_is_exact():
    ok = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    parse_json_body(ok)
    deeper = b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    with pytest.raises(OpenAIError, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse_json_body(deeper)


def test_worker_refuses_a_body_over_its_cap_with_413_before_parsing(worker):
    client, state = worker
    cap = default_max_body_bytes(MAX_MODEL_LEN)
    assert cap == 65536 + 32 * 4096
    over = json.dumps({"model": "m", "prompt": "x" * cap}).encode()
    response = client.post("/v1/completions", content=over, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    state.max_body_bytes = 2048

    def chunks():  # no Content-Length: refused while streaming in
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"y" * 1024

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_worker_batch_limit_is_configurable(worker):
    client, state = worker
    state.max_prompts = 2
    response = client.post("/v1/completions", json={"model": "m", "prompt": [[1, 2], [3], [4]]})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("a batch may hold at most 2 prompts, got 3")


def test_tokenizing_a_long_prompt_lets_other_threads_run():
    """The router counts tokens in a worker thread; a tokenizer call that held the GIL (``encode``) froze the
    event loop for the whole call anyway (the review's 6 MB prompt stalled /health for 7.6 s). Counted here:
    while ~1 MB is tokenized, another thread must get the GIL many times."""
    counter = PromptCounter(gemma_tokenizer_dir())
    text = "The quick brown fox jumps over the lazy dog. " * 4_000
    ticks, done = [0], threading.Event()

    def tick():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        before = ticks[0]
        started = time.perf_counter()
        num_tokens = counter.count("/v1/completions", {"prompt": text})
        elapsed = time.perf_counter() - started
        during = ticks[0] - before
    finally:
        done.set()
        thread.join()
    assert num_tokens == 40_002  # <bos> + 10 tokens per sentence + the trailing space
    assert during >= 10, f"only {during} ticks of the other thread in {elapsed:.2f}s of tokenization"
