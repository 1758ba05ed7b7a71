"""LocalAgentBackend deletes are idempotent: a process that is gone, or that another request is already stopping
(the agent's 409 "already being stopped"), is stopped once it is gone, never a failure.

Regression: a reconcile ``pool.apply`` failed with ``Conflict: DELETE /v1/processes/decode-canary-0: process
'decode-canary-0' is already being stopped`` while a rollout's ``pool.track_delete`` was stopping that canary.
The call sequences use httpx's MockTransport; the race runs on a real agent with a real router process
(no model to load) held by SIGSTOP so that the first stop is still draining when the second one arrives.
"""

import os
import signal
import threading
import time

import httpx
import pytest

from apps.orchestrators.base import BackendUnavailable, PoolRef
from apps.orchestrators.local_backend import STOP_POLL_S, LocalAgentBackend
from inference_worker.tests.support.agent import AgentProcess, wait_for

POOL = PoolRef(pool_id=1, pool_name="decode")
STOPPING = {"detail": "process 'decode-canary-0' is already being stopped"}
PROCESS = {"name": "decode-canary-0", "drain_timeout_s": 1,
           "labels": {"ferry.io/pool": "decode", "ferry.io/track": "canary"}}


def agent_answering(delete_statuses, sleeps):
    """A fake agent: one canary process whose DELETEs answer ``delete_statuses`` in turn (the last repeats)."""
    calls = []

    def handler(request):
        calls.append((request.method, request.url.path))
        if request.method == "GET":
            return httpx.Response(200, json=[PROCESS])
        if request.url.path.startswith("/v1/templates/"):
            return httpx.Response(204)
        deletes = sum(1 for method, path in calls if method == "DELETE" and path.startswith("/v1/processes/"))
        status = delete_statuses[min(deletes, len(delete_statuses)) - 1]
        return httpx.Response(status, json=STOPPING if status == 409 else {"detail": "gone"} if status == 404
                              else {**PROCESS, "alive": False})

    return LocalAgentBackend("http://agent.invalid", "t" * 20, sleep=sleeps.append,
                             transport=httpx.MockTransport(handler)), calls


def test_delete_track_waits_for_another_requests_stop_and_succeeds_once_the_process_is_gone():
    sleeps = []
    backend, calls = agent_answering([409, 409, 404], sleeps)
    backend.delete_track(POOL, "canary")
    assert calls == [("GET", "/v1/processes"), *[("DELETE", "/v1/processes/decode-canary-0")] * 3,
                     ("DELETE", "/v1/templates/decode-canary")]
    assert sleeps == [STOP_POLL_S, STOP_POLL_S] == [0.5, 0.5]


def test_a_stop_that_wins_after_a_restart_by_someone_else_is_a_plain_stop():
    sleeps = []
    backend, calls = agent_answering([409, 200], sleeps)
    backend.delete_track(POOL, "canary")
    assert [c for c in calls if c[0] == "DELETE"] == [("DELETE", "/v1/processes/decode-canary-0")] * 2 + [
        ("DELETE", "/v1/templates/decode-canary")]
    assert sleeps == [0.5]


def test_a_process_still_being_stopped_after_drain_plus_15_s_is_retryable_backend_unavailable():
    sleeps = []
    backend, calls = agent_answering([409], sleeps)
    with pytest.raises(BackendUnavailable, match="'decode-canary-0' is still being stopped by another request "
                                                 "after 16s: .*already being stopped") as info:
        backend.delete_track(POOL, "canary")
    assert info.value.retryable is True
    assert sleeps == [0.5] * 32  # drain_timeout_s 1 + 15 s
    assert ("DELETE", "/v1/templates/decode-canary") not in calls


@pytest.fixture
def agent(tmp_path):
    running = AgentProcess(tmp_path / "state").start()
    yield running
    running.terminate()


def test_two_concurrent_delete_tracks_on_a_real_agent_both_succeed(agent, tmp_path):
    table = tmp_path / "table.json"
    table.write_text('{"version": 1, "tracks": [], "pools": []}')
    labels = {"ferry.io/pool": "decode", "ferry.io/track": "canary"}
    with agent.client() as client:
        client.put("/v1/templates/decode-canary", json={"labels": labels, "replicas": 1}).raise_for_status()
        started = client.post("/v1/processes", json={
            "name": "decode-canary-0", "args": ["router", "--routing-table", str(table), "--scrape-interval", "0"],
            "env": {"OMP_NUM_THREADS": "1"}, "labels": labels, "drain_timeout_s": 60}).json()
        pid = started["pid"]
        os.kill(pid, signal.SIGSTOP)  # SIGTERM stays pending: the first stop drains until SIGCONT
        try:
            first, second, first_sleeps, second_sleeps, errors = _race_two_deletes(agent, client, pid)
        finally:
            _continue(pid)  # never leave a stopped process behind, even when an assertion failed
        assert (first.is_alive(), second.is_alive(), errors, first_sleeps) == (False, False, [], [])
        assert set(second_sleeps) == {0.5}
        assert client.get("/v1/processes/decode-canary-0").status_code == 404
        assert client.get("/v1/templates", params={"selector": "ferry.io/pool=decode"}).json() == {}


def _continue(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _race_two_deletes(agent, client, pid):
    """Start a first ``delete_track`` (it drains the stopped process), then a second one once the first is
    stopping; let the process go once the second has been answered 409 twice. Returns both threads (joined),
    each one's sleeps and any exception either raised."""
    first_sleeps, second_sleeps, errors = [], [], []

    def delete(sleeps):
        backend = LocalAgentBackend(agent.base_url, agent.token, sleep=lambda s: (sleeps.append(s), time.sleep(s)))
        try:
            backend.delete_track(POOL, "canary")
        except Exception as exc:  # noqa: BLE001 - the test reports any failure of either caller
            errors.append(exc)
        finally:
            backend.close()

    first = threading.Thread(target=delete, args=(first_sleeps,))
    first.start()
    assert wait_for(lambda: client.get("/v1/processes/decode-canary-0").json()["stopping"], 10, 0.05)
    second = threading.Thread(target=delete, args=(second_sleeps,))
    second.start()
    assert wait_for(lambda: len(second_sleeps) >= 2 or errors, 10, 0.05)
    assert (errors, first.is_alive(), second.is_alive()) == ([], True, True)  # the second waits on 409s
    _continue(pid)
    first.join(30)
    second.join(30)
    return first, second, first_sleeps, second_sleeps, errors
