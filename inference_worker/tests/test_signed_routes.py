"""Signed internal routes and routing errors, in-process (no model needed: each check answers before the engine).

Regression tests for the tester's findings on issue 16: a non-ASCII signature was a 500 (``compare_digest`` of
``str``), an unsigned 200 MiB reset body was buffered before the 401, ``after`` took ``1_000``/``+5``/Unicode
digits and echoed a 5000-digit value, and 404/405 used FastAPI's ``{"detail": ...}`` shape.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from inference_worker import http_headers
from inference_worker.metrics import WorkerMetrics
from inference_worker.server.app import create_app
from inference_worker.server.errors import OpenAIError
from inference_worker.server.kv_cache_routes import KV_EVENTS_PATH, MAX_RESET_BODY_BYTES, RESET_PATH
from inference_worker.server.pd import max_prefill_body_bytes
from inference_worker.server.signing import read_body_capped, sign, verify_signature
from inference_worker.server.state import ServerState

SECRET = b"signed-routes-secret"
BODY = b"{}"
GOOD = sign(SECRET, BODY)


@pytest.fixture()
def client():
    state = ServerState(served_model_name="m", metrics=WorkerMetrics({"model": "m", "role": "colocated"},
                                                                      CollectorRegistry()), link_secret=SECRET)
    with TestClient(create_app(state), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("header", [None, "", "é" * 64, GOOD[:-1], GOOD + "0", "g" * 64, "0" * 64, " " + GOOD[1:]])
def test_bad_signatures_are_401_never_500(header):
    with pytest.raises(OpenAIError) as info:
        verify_signature(SECRET, BODY, header)
    assert (info.value.status_code, info.value.code) == (401, "invalid_signature")


def test_signature_accepts_lower_and_upper_case_hex():
    verify_signature(SECRET, BODY, GOOD)
    verify_signature(SECRET, BODY, GOOD.upper())  # hex is case-insensitive (RFC 4648 s.8): same digest bytes


@pytest.mark.parametrize("header", ["é" * 64, "\u00ff" * 10, GOOD[:63]])
def test_reset_route_answers_401_for_non_ascii_or_short_signature(client, header):
    response = client.post(RESET_PATH, content=BODY, headers={http_headers.KV_SIGNATURE: header.encode("latin-1")})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_signature"


def test_reset_route_with_upper_case_signature_passes_the_check(client):
    # past the signature the route needs the engine: 503 not_ready proves the signature was accepted
    response = client.post(RESET_PATH, content=BODY, headers={http_headers.KV_SIGNATURE: GOOD.upper()})
    assert (response.status_code, response.json()["error"]["code"]) == (503, "not_ready")


def test_reset_body_over_the_cap_is_413_from_content_length(client):
    response = client.post(RESET_PATH, content=b"x" * (MAX_RESET_BODY_BYTES + 1))
    assert response.status_code == 413
    assert response.json()["error"] == {
        "message": f"request body too large: this route accepts at most {MAX_RESET_BODY_BYTES} bytes",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def _request(headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
    from starlette.requests import Request
    received = []

    async def receive():
        chunk = chunks.pop(0)
        received.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    return Request({"type": "http", "method": "POST", "headers": headers}, receive), received


def test_capped_read_refuses_content_length_without_reading_and_chunked_body_at_the_cap():
    request, received = _request([(b"content-length", b"101")], [b"x" * 101])
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_body_capped(request, 100))
    assert info.value.status_code == 413 and received == []
    request, received = _request([], [b"x" * 60, b"x" * 60, b"x" * 60])  # chunked: no length
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_body_capped(request, 100))
    assert info.value.status_code == 413 and len(received) == 2  # stopped at the chunk that passed the cap
    request, _ = _request([], [b"x" * 50, b"x" * 50])
    assert asyncio.run(read_body_capped(request, 100)) == b"x" * 100


def test_prefill_body_cap_fits_a_max_model_len_prompt():
    assert max_prefill_body_bytes(32768) == 12 * 32768 + 65_536
    import json
    body = json.dumps({"request_id": "r" * 40, "prompt_token_ids": [2**32 - 1] * 32768, "sampling": {},
                       "kv_host": "h" * 255, "kv_port": 65535, "model_version_id": "v" * 200}).encode()
    assert len(body) <= max_prefill_body_bytes(32768)


@pytest.mark.parametrize("value", ["1_000", "+5", " 9 ", "٣", "-1", "1e3", ""])
def test_after_must_be_ascii_digits(client, value):
    response = client.get(KV_EVENTS_PATH, params={"after": value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "after"


def test_over_long_after_is_quoted_truncated(client):
    response = client.get(KV_EVENTS_PATH, params={"after": "9" * 5000})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "after must be a sequence number of at most 20 digits 0-9, got '" + "9" * 32 + "... (5000 chars)'")


def test_routing_errors_use_openai_error_json(client):
    response = client.get(RESET_PATH)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json() == {"error": {"message": "Method Not Allowed", "type": "invalid_request_error",
                                         "param": None, "code": "method_not_allowed"}}
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


@pytest.fixture()
def prefill_client():
    from types import SimpleNamespace

    from inference_worker.server.pd import PDService, PDSettings
    from inference_worker.server.state import ServedModel

    def capacity_error(num_prompt_tokens, max_tokens):  # a cache of 100 tokens, as the scheduler words it
        need = num_prompt_tokens + max_tokens
        return None if need <= 100 else f"needs up to {need} full_attention blocks but the KV cache has 100"

    metrics = WorkerMetrics({"model": "m", "role": "prefill"}, CollectorRegistry())
    model = ServedModel(engine_loop=SimpleNamespace(alive=True), tokenizer=None, chat_template=None, max_model_len=64,
                        vocab_size=1000, make_sampling_params=dict, kv_capacity_error=capacity_error)
    pd = PDService(PDSettings(role="prefill", link_secret=SECRET, model_version_id="v1"), metrics)
    state = ServerState(served_model_name="m", metrics=metrics, link_secret=SECRET, pd=pd, model=model)
    with TestClient(create_app(state), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("header", ["é" * 64, GOOD[:63], "z" * 64])
def test_prefill_route_answers_401_for_non_ascii_or_malformed_signature(prefill_client, header):
    from inference_worker.server.pd import PREFILL_PATH
    response = prefill_client.post(PREFILL_PATH, content=BODY,
                                   headers={http_headers.KV_SIGNATURE: header.encode("latin-1")})
    assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_signature")


def test_prefill_route_refuses_a_body_over_its_cap_with_413(prefill_client):
    from inference_worker.server.pd import PREFILL_PATH
    cap = max_prefill_body_bytes(64)
    response = prefill_client.post(PREFILL_PATH, content=b" " * (cap + 1))
    assert response.status_code == 413
    assert response.json()["error"]["message"] == f"request body too large: this route accepts at most {cap} bytes"


def test_prefill_of_a_prompt_the_cache_cannot_hold_is_400_before_the_engine(prefill_client):
    import json

    from inference_worker.server.pd import PREFILL_PATH
    body = json.dumps({"request_id": "r", "prompt_token_ids": [1] * 100, "kv_host": "127.0.0.1", "kv_port": 1,
                       "model_version_id": "v1"}).encode()
    response = prefill_client.post(PREFILL_PATH, content=body, headers={http_headers.KV_SIGNATURE: sign(SECRET, body)})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "prompt (100 tokens) plus max_tokens (1) needs up to 101 full_attention blocks but the KV cache "
                   "has 100", "type": "invalid_request_error", "param": "prompt_token_ids",
        "code": "context_length_exceeded"}


def test_prefill_of_a_prompt_over_max_model_len_is_400_before_the_engine(prefill_client):
    """The cache holds 64 tokens plus one, the context (max_model_len 64) does not: a 400, not the engine's error."""
    import json

    from inference_worker.server.pd import PREFILL_PATH
    body = json.dumps({"request_id": "r", "prompt_token_ids": [1] * 64, "kv_host": "127.0.0.1", "kv_port": 1,
                       "model_version_id": "v1"}).encode()
    response = prefill_client.post(PREFILL_PATH, content=body, headers={http_headers.KV_SIGNATURE: sign(SECRET, body)})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "the prompt has 64 tokens; with its first output token it exceeds this prefill worker's context "
                   "of 64 tokens", "type": "invalid_request_error", "param": "prompt_token_ids",
        "code": "context_length_exceeded"}
