"""A request that can never fit in the KV cache is the client's error (400), decided before the engine.

In-process against the FastAPI app: the served model's capacity check is a real (torch-free) scheduler
over a small cache, and the engine loop is a stand-in that fails any use, so a request that got past the
check would be a 500 (the tester saw 500 ``engine_error`` counted as ``server_error``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from inference_worker.engine.kv_cache_manager import HybridKVCacheManager
from inference_worker.engine.kv_cache_sizing import KVCacheGroupSpec
from inference_worker.engine.scheduler import Scheduler
from inference_worker.metrics import WorkerMetrics
from inference_worker.server.app import create_app
from inference_worker.server.state import ServedModel, ServerState

BS = 16
MAX_MODEL_LEN = 32768
NUM_FULL_BLOCKS = 116  # the tester's cache: 116 full_attention blocks of 16 tokens = 1856 tokens


@pytest.fixture()
def served():
    groups = [KVCacheGroupSpec("full_attention", (0,), None, NUM_FULL_BLOCKS + 1, BS)]
    scheduler = Scheduler(HybridKVCacheManager(groups), max_num_seqs=8, max_num_batched_tokens=2048,
                          max_model_len=MAX_MODEL_LEN)
    registry = CollectorRegistry()
    model = ServedModel(engine_loop=SimpleNamespace(alive=True), tokenizer=None, chat_template=None,
                        max_model_len=MAX_MODEL_LEN, vocab_size=1000, make_sampling_params=dict,
                        max_request_tokens=scheduler.max_request_tokens(), kv_capacity_error=scheduler.capacity_error)
    state = ServerState(served_model_name="m", metrics=WorkerMetrics({"model": "m", "role": "colocated"}, registry),
                        model=model)
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        yield client, registry


def outcome(registry, name):
    labels = {"model": "m", "model_version": "", "pool": "", "replica": "", "role": "colocated", "track": ""}
    return registry.get_sample_value("ferry_requests_total", labels | {"outcome": name})


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_that_can_never_fit_is_400_context_length_exceeded_and_a_client_error(served, stream):
    client, registry = served
    response = client.post("/v1/completions", json={"model": "m", "prompt": [1] * 1800, "max_tokens": 104,
                                                     "stream": stream})
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": "prompt (1800 tokens) plus max_tokens (104) needs up to 119 full_attention blocks but the KV cache "
                   "has 116; raise --kv-cache-memory or lower max_tokens",
        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}}
    assert (outcome(registry, "client_error"), outcome(registry, "server_error")) == (1.0, 0.0)


def test_models_advertises_the_context_the_cache_holds(served):
    client, _ = served
    card = client.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == NUM_FULL_BLOCKS * BS == 1856


def test_a_prompt_filling_the_cache_with_the_default_max_tokens_is_400(served):
    client, _ = served
    response = client.post("/v1/completions", json={"model": "m", "prompt": [1] * 1856})  # max_tokens defaults to 16
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "prompt (1856 tokens) plus max_tokens (16) needs up to 117 full_attention blocks but the KV cache has 116; "
        "raise --kv-cache-memory or lower max_tokens")
