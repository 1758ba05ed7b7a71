"""The worker credential (issue 19): with ``FERRY_WORKER_TOKEN`` every route but the probes needs the pool's
token; in-process, no model (each check answers before the engine: 503 ``not_ready`` proves a request got past
authentication)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from inference_worker.metrics import WorkerMetrics
from inference_worker.server.app import create_app
from inference_worker.server.kv_cache_routes import RESET_PATH
from inference_worker.server.state import ServerState
from inference_worker.server.worker_auth import WorkerTokens

TOKEN = "pool-token-0123456789abcdef"
PREVIOUS = "old-pool-token-0123456789"
MISSING = {"error": {"message": "missing worker token: send 'Authorization: Bearer <the pool's worker token>' "
                                "(routers take it from the routing table)",
                     "type": "authentication_error", "param": None, "code": "invalid_worker_token"}}


def make_client(tokens: WorkerTokens | None) -> TestClient:
    state = ServerState(served_model_name="m", worker_tokens=tokens,
                        metrics=WorkerMetrics({"model": "m", "role": "colocated"}, CollectorRegistry()))
    return TestClient(create_app(state), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client():
    with make_client(WorkerTokens(TOKEN, PREVIOUS)) as c:
        yield c


PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("GET", "/v1/kv-events"), ("POST", RESET_PATH), ("GET", "/no-such-route")]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_route_but_the_probes_refuses_a_missing_token_with_401(client, method, path):
    response = client.request(method, path, json={"model": "m", "prompt": "hi"})
    assert response.status_code == 401
    assert response.json() == MISSING
    assert response.headers["www-authenticate"] == 'Bearer realm="ferry-worker"'


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN,
                                    "Bearer ", f"Bearer {'é' * 27}"])
def test_a_wrong_token_is_401_without_echoing_it(client, header):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                           headers={"Authorization": header.encode("utf-8")})
    assert response.status_code == 401
    assert response.json()["error"]["message"].startswith("invalid worker token: send")
    assert TOKEN[:8] not in response.text


@pytest.mark.parametrize("token", [TOKEN, PREVIOUS])
def test_the_current_and_the_previous_token_are_accepted(client, token):
    auth = {"Authorization": f"Bearer {token}"}
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=auth)
    assert (response.status_code, response.json()["error"]["code"]) == (503, "not_ready")
    assert client.get("/v1/models", headers={"Authorization": f"bearer {token}"}).json()["data"][0]["id"] == "m"
    # the reset needs no link-secret signature on a worker with a token: past the check it needs the engine
    response = client.post(RESET_PATH, content=b"{}", headers=auth)
    assert (response.status_code, response.json()["error"]["code"]) == (503, "not_ready")


def test_health_ready_and_metrics_stay_open(client):
    assert client.get("/health").json() == {"status": "ok", "engine": "loading"}
    assert client.get("/ready").status_code == 503  # loading: open, but not ready
    assert client.get("/ready").json() == {"ready": False, "reason": "loading"}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "ferry_worker" in metrics.text


def test_the_slow_request_timeline_stays_open_for_the_poller():
    """The telemetry poller reads ``/debug/slow-requests`` without a worker token (like a /metrics scrape): with
    it behind the token, a pool with worker tokens had no worker phases on its page (every read a 401)."""
    with make_client(WorkerTokens(TOKEN)) as client:
        response = client.get("/debug/slow-requests?limit=5")
        assert (response.status_code, response.json()) == (200, {"role": "colocated", "capacity": 512, "requests": []})
        assert client.get("/debug/slow-requests?limit=0").status_code == 400  # its own checks still apply


def test_without_a_token_the_worker_stays_open():
    with make_client(None) as open_client:
        response = open_client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert (response.status_code, response.json()["error"]["code"]) == (503, "not_ready")


def test_tokens_come_from_the_environment_and_are_checked():
    assert WorkerTokens.from_env({}) is None
    assert WorkerTokens.from_env({"FERRY_WORKER_TOKEN": ""}) is None
    tokens = WorkerTokens.from_env({"FERRY_WORKER_TOKEN": TOKEN, "FERRY_WORKER_TOKEN_PREVIOUS": PREVIOUS})
    assert tokens == WorkerTokens(TOKEN, PREVIOUS)
    assert TOKEN not in repr(tokens) and PREVIOUS not in repr(tokens)
    for bad in ("short", "has a space in it!!", "x" * 15):
        with pytest.raises(ValueError, match="at least 16 printable ASCII characters"):
            WorkerTokens.from_env({"FERRY_WORKER_TOKEN": bad})
