"""LocalAgentBackend's failure policy: backoff on 5xx and transport errors, typed errors otherwise.

The 5xx cases use httpx's MockTransport (an HTTP-level fake: the real agent never answers 5xx on
purpose); the unreachable case uses a real closed port.
"""

import socket

import httpx
import pytest

from apps.orchestrators.base import BackendUnavailable, Conflict, InvalidSpec, NotFound, PoolRef
from apps.orchestrators.local_backend import LocalAgentBackend

POOL = PoolRef(pool_id=1, pool_name="p")


def backend_answering(statuses, sleeps):
    calls = []

    def handler(request):
        calls.append((request.method, request.url.path, request.headers["authorization"]))
        status = statuses[min(len(calls) - 1, len(statuses) - 1)]
        if status == 200:
            return httpx.Response(200, json={"p-stable": {"labels": {"ferry.io/track": "stable"}, "replicas": 0}}
                                  if request.url.path == "/v1/templates" else [])
        return httpx.Response(status, json={"detail": f"status {status}"})

    backend = LocalAgentBackend("http://agent.invalid", "t" * 20, max_attempts=3, backoff_s=0.1,
                                sleep=sleeps.append, transport=httpx.MockTransport(handler))
    return backend, calls


def test_5xx_is_retried_with_exponential_backoff_then_backend_unavailable():
    sleeps = []
    backend, calls = backend_answering([503], sleeps)
    with pytest.raises(BackendUnavailable, match="failed 3 times: HTTP 503: status 503"):
        backend.observe(POOL)
    assert len(calls) == 3 and sleeps == [0.1, 0.2]
    assert calls[0] == ("GET", "/v1/templates", "Bearer " + "t" * 20)


def test_one_5xx_then_success():
    sleeps = []
    backend, calls = backend_answering([500, 200], sleeps)
    observed = backend.observe(POOL)
    assert observed.tracks["stable"].desired_replicas == 0
    assert sleeps == [0.1]


@pytest.mark.parametrize("status, error", [(404, NotFound), (409, Conflict), (400, InvalidSpec), (422, InvalidSpec)])
def test_4xx_map_to_typed_errors_without_retry(status, error):
    sleeps = []
    backend, calls = backend_answering([status], sleeps)
    with pytest.raises(error, match=f"status {status}"):
        backend.observe(POOL)
    assert len(calls) == 1 and sleeps == []


def test_unreachable_agent_is_backend_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleeps = []
    backend = LocalAgentBackend(f"http://127.0.0.1:{port}", "t" * 20, max_attempts=2, backoff_s=0.05,
                                sleep=sleeps.append)
    with pytest.raises(BackendUnavailable, match="ConnectError") as info:
        backend.observe(POOL)
    assert info.value.retryable and sleeps == [0.05]
