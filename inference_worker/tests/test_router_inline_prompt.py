"""Short bodies are parsed and tokenized on the router's event loop, long ones on its prompt thread pool
(``app.INLINE_BODY_BYTES``), with the same result either way; the first request of a model version goes to the
pool whatever its size (loading the tokenizer is file work). In process: the router app under TestClient, its
upstream client pointed at a worker stand-in."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from inference_worker.router.app import INLINE_BODY_BYTES, Router, RouterConfig
from inference_worker.router.prompt import PromptHasher
from inference_worker.router.table import ModelInfo

SHA = "ab" * 32
SMOL = ModelInfo("smol", "smollm2-135m-instruct", SHA, "float32", 4)  # its tokenizer.json is small


def table() -> dict:
    return {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
            "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1",
                       "replicas": [{"name": "w0", "url": "http://w0", "track": "stable"}]}],
            "models": {"v1": {"layer_types": ["full_attention"] * 2, "sliding_window": 0, "num_kv_heads": 1,
                              "head_dim": 8, "dtype": "float32", "model": "smol", "tokenizer": SMOL.tokenizer,
                              "weights_sha256": SHA, "kv_dtype": "float32", "block_size": 4}}}


async def worker(scope, receive, send):
    """A worker stand-in answering every completion with 200."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"choices": []}'})


def test_short_bodies_stay_on_the_loop_long_ones_go_to_the_pool_and_both_count_the_same_tokens(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table()))
    router = Router(RouterConfig(routing_table=str(path), scrape_interval_s=0, kv_index=False, max_attempts=1))
    handed_off = []
    off_loop = router._off_loop

    async def counting(fn, *args):
        handed_off.append(getattr(fn, "func", fn).__name__)
        return await off_loop(fn, *args)

    router._off_loop = counting
    short, long = "the cat sat on the mat " * 4, "the cat sat on the mat " * 100
    assert len(json.dumps({"model": "smol", "prompt": short})) <= INLINE_BODY_BYTES < len(long)
    calls = []
    with TestClient(router.app) as client:
        router.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=worker))
        for prompt in (short, short, long):
            before = len(handed_off)
            response = client.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 1},
                                   headers={"X-Request-Id": f"r{len(calls)}"})
            assert response.status_code == 200
            calls.append(handed_off[before:])
        records = {r["request_id"]: r for r in client.get("/debug/slow-requests").json()["requests"]}
    # the first request loads the tokenizer on the pool; later short ones do nothing off the loop
    assert calls == [["info"], [], ["parse_json_body", "info"]]
    expected = [PromptHasher().info("v1", SMOL, "/v1/completions", {"prompt": p}).num_tokens
                for p in (short, short, long)]
    got = [next(p["attributes"]["num_prompt_tokens"] for p in records[f"r{i}"]["phases"] if p["name"] == "router.route")
           for i in range(3)]
    assert got == expected and expected[0] < expected[2]
