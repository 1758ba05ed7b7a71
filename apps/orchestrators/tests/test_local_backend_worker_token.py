"""The local backend gives workers their pool's token in the process environment, never in the arguments (``ps``
shows those to every user of the host); a rotation changes the env, so the agent's replicas are replaced."""

import json

import httpx

from apps.orchestrators.base import ModelRef, PoolRef, PoolTrackSpec
from apps.orchestrators.local_backend import LocalAgentBackend

TOKEN, PREVIOUS = "pool-token-0123456789abcdef", "old-pool-token-0123456789"


def recording_agent(running: list[dict]):
    """An agent stand-in (httpx MockTransport) whose processes are ``running``; returns (backend, requests)."""
    requests = []

    def handler(request):
        body = json.loads(request.content) if request.content else None
        requests.append((request.method, request.url.path, body))
        if request.method == "GET" and request.url.path == "/v1/processes":
            return httpx.Response(200, json=running)
        return httpx.Response(200, json={})

    backend = LocalAgentBackend("http://agent.invalid", "a" * 20, sleep=lambda s: None,
                                transport=httpx.MockTransport(handler))
    return backend, requests


def spec(**tokens):
    return PoolTrackSpec(pool=PoolRef(pool_id=3, pool_name="decode"), role="decode", track="stable", replicas=1,
                         model=ModelRef(name="gemma-3-270m", version="v1"), env={"OMP_NUM_THREADS": "1"}, **tokens)


def test_the_token_goes_in_the_process_env_never_in_args():
    backend, requests = recording_agent(running=[])
    backend.apply_pool_track(spec(worker_token=TOKEN, worker_token_previous=PREVIOUS))
    (template,) = [body for method, path, body in requests if method == "PUT"]
    (start,) = [body for method, path, body in requests if (method, path) == ("POST", "/v1/processes")]
    env = {"OMP_NUM_THREADS": "1", "FERRY_WORKER_TOKEN": TOKEN, "FERRY_WORKER_TOKEN_PREVIOUS": PREVIOUS}
    assert template["env"] == start["env"] == env
    assert start["name"] == "decode-stable-0"
    assert not any(TOKEN in arg or PREVIOUS in arg for arg in start["args"])


def test_a_rotated_token_replaces_the_running_replica():
    old_env = {"OMP_NUM_THREADS": "1", "FERRY_WORKER_TOKEN": PREVIOUS}
    running = [{"name": "decode-stable-0", "args": spec().worker_args(), "env": old_env, "drain_timeout_s": 30,
                "labels": {}}]
    backend, requests = recording_agent(running)
    backend.apply_pool_track(spec(worker_token=TOKEN, worker_token_previous=PREVIOUS))
    assert [(m, p) for m, p, _ in requests if m in ("DELETE", "POST")] == [
        ("DELETE", "/v1/processes/decode-stable-0"), ("POST", "/v1/processes")]
