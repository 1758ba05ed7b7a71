"""The agent's HTTP API as a real process: bearer auth, command validation, templates, persistence."""

import json
import signal

import pytest

from inference_worker.agent.processes import validate_args, validate_env
from inference_worker.agent.state import InvalidRequest
from inference_worker.tests.support.agent import AgentProcess


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    process = AgentProcess(tmp_path_factory.mktemp("agent") / "state").start()
    yield process
    # uvicorn re-raises SIGTERM after the lifespan shutdown (which stopped the workers).
    assert process.terminate() == -signal.SIGTERM


def test_health_needs_no_token(agent):
    import httpx

    assert httpx.get(agent.base_url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"},
                                     {"Authorization": "Basic dXNlcjpwYXNz"}])
def test_missing_or_wrong_token_is_401(agent, headers):
    import httpx

    for method, path in (("GET", "/v1/processes"), ("POST", "/v1/processes"), ("DELETE", "/v1/processes/x"),
                         ("GET", "/v1/templates")):
        response = httpx.request(method, agent.base_url + path, headers=headers, json={})
        assert response.status_code == 401, (method, path)
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json() == {"detail": "missing or wrong bearer token"}


@pytest.mark.parametrize("body, message", [
    ({"name": "w-0", "args": ["bash", "-c", "id"]}, "args must start with one of serve, router"),
    ({"name": "w-0", "args": []}, "args must start with one of serve, router"),
    ({"name": "w-0", "args": ["models", "prepare", "x"]}, "args must start with one of serve, router"),
    ({"name": "w-0", "args": ["serve", "--model", "m", "--port", "80"]}, "--port is set by the agent"),
    ({"name": "w-0", "args": ["serve", "--host=0.0.0.0"]}, "--host is set by the agent"),
    ({"name": "w-0", "args": ["serve"], "env": {"LD_PRELOAD": "/tmp/x.so"}}, "'LD_PRELOAD' is not allowed"),
    ({"name": "w-0", "args": ["serve"], "env": {"PYTHONPATH": "/tmp"}}, "'PYTHONPATH' is not allowed"),
    ({"name": "../etc", "args": ["serve"]}, "name '../etc' must be lowercase"),
])
def test_anything_but_an_inference_worker_role_is_400(agent, body, message):
    with agent.client() as client:
        response = client.post("/v1/processes", json=body)
        assert response.status_code == 400
        assert message in response.json()["detail"]
        assert client.get("/v1/processes").json() == []


def test_malformed_body_is_400(agent):
    with agent.client() as client:
        response = client.post("/v1/processes", json={"name": "w-0", "args": "serve --model m"})
        assert response.status_code == 400


def test_unknown_process_is_404(agent):
    with agent.client() as client:
        assert client.get("/v1/processes/nope").status_code == 404
        assert client.delete("/v1/processes/nope").status_code == 404
        assert client.post("/v1/processes/nope/restart").status_code == 404
        assert client.get("/v1/processes/nope/logs").status_code == 404


def test_templates_round_trip_filter_by_selector_and_persist(agent):
    template = {"labels": {"ferry.io/pool": "p1", "ferry.io/track": "stable"}, "args": ["serve"], "replicas": 2}
    with agent.client() as client:
        assert client.put("/v1/templates/p1-stable", json=template).json() == template
        client.put("/v1/templates/p2-stable", json={"labels": {"ferry.io/pool": "p2"}, "replicas": 0})
        assert client.get("/v1/templates/p1-stable").json() == template
        assert list(client.get("/v1/templates", params={"selector": "ferry.io/pool=p1"}).json()) == ["p1-stable"]
        assert client.get("/v1/templates", params={"selector": "bad"}).status_code == 400
        saved = json.loads((agent.state_dir / "agent.json").read_text())
        assert saved["templates"]["p1-stable"] == template
        assert client.delete("/v1/templates/p2-stable").status_code == 204
        assert client.get("/v1/templates/p2-stable").status_code == 404


def test_validators_directly():
    assert validate_args(["router", "--routing-table-file", "rt.json"]) == ["router", "--routing-table-file", "rt.json"]
    assert validate_env({"FERRY_X": "1", "OMP_NUM_THREADS": "1"}) == {"FERRY_X": "1", "OMP_NUM_THREADS": "1"}
    with pytest.raises(InvalidRequest, match="--replica is set by the agent"):
        validate_args(["serve", "--replica", "x"])
    with pytest.raises(InvalidRequest, match="not a plain string"):
        validate_args(["serve", "a\x00b"])
