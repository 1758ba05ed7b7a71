"""End to end on this host: REST API -> Action -> real Celery worker -> local backend -> real agent -> real
Gemma 3 270M worker processes. Scale 0 -> 2 -> 1 (the stopped replica finishes its in-flight request),
then a killed worker is restarted by reconcile. One test, because the flow shares processes and the
transactional database is flushed between tests; never more than two model workers at a time.
"""

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from apps.fleet.services import cluster_create, pool_create
from apps.operations.backends import pool_ref
from apps.operations.models import Action
from apps.operations.reconcile import reconcile_all
from apps.orchestrators.local_backend import LocalAgentBackend
from inference_worker.tests.support.agent import AgentProcess, wait_for

from .celery_worker import CeleryWorker, purge_queues

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

READY_TIMEOUT_S = 90
WORKER_ENV = json.dumps({"TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})


@pytest.fixture
def agent(tmp_path):
    process = AgentProcess(tmp_path / "agent").start()
    yield process
    process.terminate()


@pytest.fixture
def local_worker(tmp_path, agent, settings):
    env = {"FERRY_AGENT_TOKEN": agent.token, "FERRY_WORKER_ENV": WORKER_ENV,
           "FERRY_WORKER_EXTRA_ARGS": "--max-num-seqs 2", "FERRY_ACTION_READY_TIMEOUT_S": "240"}
    settings.FERRY_AGENT_TOKEN = agent.token  # reconcile runs in this process
    settings.FERRY_WORKER_ENV = WORKER_ENV
    settings.FERRY_WORKER_EXTRA_ARGS = "--max-num-seqs 2"
    purge_queues()
    worker = CeleryWorker(tmp_path, env).start()
    yield worker
    worker.stop()


def test_scale_0_2_1_through_the_api_drains_and_reconcile_restarts_a_killed_worker(
        agent, local_worker, operator_api, make_model_version):
    version = make_model_version("v1", name="gemma-3-270m")
    cluster = cluster_create(name="here", kind="local", agent_url=agent.base_url, datacenter="dc1")
    pool = pool_create(name="local-a", cluster=cluster, role="colocated", model_version=version, replicas=0,
                       drain_timeout_s=60)
    backend = LocalAgentBackend(agent.base_url, agent.token)
    ref = pool_ref(pool)

    def ready_count():
        track = backend.observe(ref).tracks.get("stable")
        return track.ready_replicas if track else 0

    def scale(replicas):
        r = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": replicas}, format="json")
        assert r.status_code == 201, r.json()
        return r.json()["id"]

    def finished(action_id):
        return Action.objects.get(pk=action_id).status in ("succeeded", "failed")

    # 0 -> 2
    up = scale(2)
    assert wait_for(lambda: ready_count() == 2, READY_TIMEOUT_S), (backend.observe(ref), local_worker.log()[-3000:])
    assert wait_for(lambda: finished(up), 30)
    assert Action.objects.get(pk=up).status == "succeeded"
    replicas = backend.observe(ref).tracks["stable"].replicas
    assert [r.name for r in replicas] == ["local-a-stable-0", "local-a-stable-1"]

    # the pool's worker token reached each worker in its environment, never on its command line (ps shows that),
    # and a client calling a worker directly without it is refused
    with agent.client() as client:
        pid = client.get("/v1/processes/local-a-stable-0").json()["pid"]
    assert pool.worker_token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert f"FERRY_WORKER_TOKEN={pool.worker_token}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    direct = httpx.post(replicas[0].endpoint + "/v1/completions", timeout=30,
                        json={"model": "gemma-3-270m", "prompt": "hi", "max_tokens": 1})
    assert (direct.status_code, direct.json()["error"]["code"]) == (401, "invalid_worker_token")

    # 2 -> 1 while replica 1 (the one scale-down stops) streams a completion
    first_chunk, result = threading.Event(), {}

    def stream_completion():
        body = {"model": "gemma-3-270m", "prompt": "Write a long story about a ferry crossing a river.",
                "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", replicas[1].endpoint + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {pool.worker_token}"}) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    first_chunk.set()
        result["lines"] = lines

    thread = threading.Thread(target=stream_completion)
    thread.start()
    assert first_chunk.wait(60), "the completion never started streaming"
    down = scale(1)
    thread.join(READY_TIMEOUT_S)
    assert not thread.is_alive()
    assert result["status"] == 200 and result["lines"][-1] == "[DONE]"
    assert json.loads(result["lines"][-2])["choices"][0]["finish_reason"] == "length"
    assert wait_for(lambda: finished(down), READY_TIMEOUT_S)
    assert Action.objects.get(pk=down).status == "succeeded"
    track = backend.observe(ref).tracks["stable"]
    assert (track.ready_replicas, [r.name for r in track.replicas]) == (1, ["local-a-stable-0"])

    # kill worker 0: reconcile sees it dead and restarts it through a pool.restart_replica Action
    with agent.client() as client:
        pid = client.get("/v1/processes/local-a-stable-0").json()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not backend.observe(ref).tracks["stable"].replicas[0].alive, 10)
    tick = reconcile_all()
    assert tick.restarts == 1
    restart = Action.objects.get(kind="pool.restart_replica")
    assert restart.params["replica"] == "local-a-stable-0"
    assert restart.params["reason"] == "replica local-a-stable-0 is not running (exit code -9)"
    assert reconcile_all().restarts == 0  # a repeated tick does not restart twice
    assert wait_for(lambda: ready_count() == 1, READY_TIMEOUT_S), local_worker.log()[-3000:]
    assert wait_for(lambda: finished(restart.pk), 30)
    assert Action.objects.get(pk=restart.pk).status == "succeeded"
    (replica,) = backend.observe(ref).tracks["stable"].replicas
    assert (replica.alive, replica.restart_count) == (True, 1)
    backend.close()
