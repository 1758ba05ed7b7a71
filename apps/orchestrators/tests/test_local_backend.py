"""LocalAgentBackend end to end: a real agent process running real Gemma 3 270M workers.

The tests run in file order and share one agent (module scope) to keep model loads to three on a
2-core machine, never more than two workers at a time: scale 0 -> 2, scale 2 -> 1 with a request in
flight on the stopped replica, SIGKILL a worker and restart it, SIGKILL the agent and re-adopt.
"""

import json
import os
import signal
import threading

import httpx
import pytest

from apps.orchestrators.base import (
    ROUTING_TABLE,
    BackendError,
    InvalidSpec,
    ModelRef,
    NotFound,
    PoolRef,
    PoolTrackSpec,
)
from apps.orchestrators.local_backend import LocalAgentBackend
from inference_worker.agent.processes import read_cmdline
from inference_worker.tests.support.agent import AgentProcess, wait_for

pytestmark = pytest.mark.slow

POOL = PoolRef(pool_id=11, pool_name="local-a")
READY_TIMEOUT_S = 90
SPEC = PoolTrackSpec(
    pool=POOL, role="colocated", track="stable", replicas=0,
    model=ModelRef(name="gemma-3-270m", version="v1"),
    env={"TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    extra_args=("--max-num-seqs", "2"),
    drain_timeout_s=60,
)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("local-backend") / "agent"


@pytest.fixture(scope="module")
def agent(state_dir):
    holder = {"agent": AgentProcess(state_dir).start()}
    yield holder  # a test may replace holder["agent"] with a re-started agent on the same port
    holder["agent"].terminate()


@pytest.fixture(scope="module")
def backend(agent):
    b = LocalAgentBackend(agent["agent"].base_url, agent["agent"].token)
    yield b
    b.close()


def ready_count(backend):
    track = backend.observe(POOL).tracks.get("stable")
    return track.ready_replicas if track else 0


def agent_record(agent, name):
    with agent["agent"].client() as client:
        return client.get(f"/v1/processes/{name}").json()


def test_scale_0_to_2_gets_two_ready_workers(backend):
    backend.apply_pool_track(SPEC)
    observed = backend.observe(POOL)
    assert observed.tracks["stable"].desired_replicas == 0 and observed.tracks["stable"].replicas == ()
    backend.scale_track(POOL, "stable", 2)
    assert wait_for(lambda: ready_count(backend) == 2, READY_TIMEOUT_S), backend.observe(POOL)
    track = backend.observe(POOL).tracks["stable"]
    assert track.desired_replicas == 2
    assert [r.name for r in track.replicas] == ["local-a-stable-0", "local-a-stable-1"]
    for replica in track.replicas:
        assert (replica.alive, replica.ready, replica.version, replica.restart_count) == (True, True, "v1", 0)
        models = httpx.get(replica.endpoint + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["gemma-3-270m"]


def test_scale_2_to_1_drains_the_in_flight_request_on_the_stopped_replica(backend):
    victim = backend.observe(POOL).tracks["stable"].replicas[1]  # scale-down stops the highest index
    first_chunk = threading.Event()
    result = {}

    def stream_completion():
        body = {"model": "gemma-3-270m", "prompt": "Write a long story about a ferry crossing a river.",
                "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", victim.endpoint + "/v1/completions", json=body, timeout=120) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    first_chunk.set()
        result["lines"] = lines

    thread = threading.Thread(target=stream_completion)
    thread.start()
    assert first_chunk.wait(60), "the completion never started streaming"
    backend.scale_track(POOL, "stable", 1)  # returns once the replica has drained and exited
    thread.join(5)
    assert not thread.is_alive()
    assert result["status"] == 200
    assert result["lines"][-1] == "[DONE]"
    chunks = [json.loads(line) for line in result["lines"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    track = backend.observe(POOL).tracks["stable"]
    assert (track.desired_replicas, [r.name for r in track.replicas]) == (1, ["local-a-stable-0"])


def test_a_killed_worker_shows_not_alive_and_restart_replica_brings_it_back(backend, agent):
    pid = agent_record(agent, "local-a-stable-0")["pid"]
    os.kill(pid, signal.SIGKILL)
    dead = wait_for(lambda: not backend.observe(POOL).tracks["stable"].replicas[0].alive, 10)
    assert dead
    (replica,) = backend.observe(POOL).tracks["stable"].replicas
    assert (replica.alive, replica.ready, replica.exit_code) == (False, False, -9)
    assert "--replica local-a-stable-0" in backend.logs(POOL, "local-a-stable-0", tail=500)
    backend.restart_replica(POOL, "local-a-stable-0")
    assert wait_for(lambda: ready_count(backend) == 1, READY_TIMEOUT_S)
    (replica,) = backend.observe(POOL).tracks["stable"].replicas
    assert (replica.alive, replica.restart_count, replica.exit_code) == (True, 1, None)
    assert agent_record(agent, "local-a-stable-0")["pid"] != pid


def test_a_restarted_agent_re_adopts_its_running_workers(backend, agent):
    old = agent["agent"]
    before = agent_record(agent, "local-a-stable-0")
    old.kill()  # SIGKILL: no drain, the worker keeps running in its own session
    agent["agent"] = AgentProcess(old.state_dir, port=old.port).start()
    after = agent_record(agent, "local-a-stable-0")
    assert (after["pid"], after["port"], after["alive"], after["adopted"]) == (before["pid"], before["port"], True, True)
    assert wait_for(lambda: ready_count(backend) == 1, 15)
    backend.scale_track(POOL, "stable", 0)  # SIGTERM + drain works on an adopted worker too
    assert backend.observe(POOL).tracks["stable"].replicas == ()
    # Gone (or a zombie of whoever adopted it: in a container PID 1 may never reap it).
    assert wait_for(lambda: read_cmdline(before["pid"]) is None, 10)


def test_verbs_without_a_worker(backend):
    assert backend.set_traffic_weights(POOL, {"stable": 90, "canary": 10}) == ROUTING_TABLE
    assert backend.switch_active(POOL, "green") == ROUTING_TABLE
    with pytest.raises(NotFound):
        backend.scale_track(PoolRef(pool_id=1, pool_name="never-applied"), "stable", 1)
    with pytest.raises(NotFound):
        backend.restart_replica(POOL, "local-a-stable-9")
    with pytest.raises(InvalidSpec):
        backend.scale_track(POOL, "stable", -1)
    backend.delete_track(POOL, "stable")
    backend.delete_track(POOL, "stable")  # idempotent
    assert backend.observe(POOL).tracks == {}


def test_wrong_token_is_a_non_retryable_backend_error(agent):
    bad = LocalAgentBackend(agent["agent"].base_url, "wrong-token-0123456789", sleep=lambda s: None)
    with pytest.raises(BackendError, match="rejected the token") as info:
        bad.observe(POOL)
    assert info.value.retryable is False
