"""A worker whose model fails to load exits non-zero and says why; reconcile restarts it with backoff.

Real processes: the local agent runs ``inference_worker serve`` with a model that does not exist. The
worker exits with status 3 after writing "model failed to load: ..." to its termination message file;
the agent reports it dead with that message (it never restarts on its own); reconcile's
``pool_converge`` asks for a restart at once after the first death, then waits out the backoff
(``restart_backoff_s``: none, then 10 s doubling, capped) counted from each death.
"""

import pytest

from apps.fleet.models import Replica
from apps.fleet.services import cluster_create, pool_create, replicas_refresh
from apps.operations.backends import pool_ref
from apps.operations.models import Action
from apps.operations.reconcile import pool_converge, restart_backoff_s
from apps.operations.services import action_cancel
from apps.orchestrators.base import ModelRef, PoolTrackSpec
from apps.orchestrators.local_backend import LocalAgentBackend
from inference_worker.server.lifecycle import EXIT_MODEL_LOAD_FAILED
from inference_worker.tests.support.agent import AgentProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

ERROR = ("model failed to load: ValueError: --model 'no-such-model' is neither a built-in model (gemma-3-270m, "
         "smollm2-135m-instruct), an existing .gguf file, nor a directory with config.json")


def test_restart_backoff_is_none_then_doubles_from_the_base_up_to_the_cap(settings):
    settings.FERRY_RESTART_BACKOFF_S, settings.FERRY_RESTART_BACKOFF_MAX_S = 10, 300
    assert [restart_backoff_s(n) for n in range(8)] == [0, 10, 20, 40, 80, 160, 300, 300]


def test_a_worker_that_cannot_load_its_model_exits_3_and_reconcile_restarts_it_with_backoff(
        tmp_path, make_model_version, settings, viewer_api):
    settings.FERRY_RESTART_BACKOFF_S, settings.FERRY_RESTART_BACKOFF_MAX_S = 10, 300
    agent = AgentProcess(tmp_path / "agent").start()
    backend = LocalAgentBackend(agent.base_url, agent.token)
    try:
        version = make_model_version("v1", name="no-such-model")
        cluster = cluster_create(name="here", kind="local", agent_url=agent.base_url, datacenter="dc1")
        pool = pool_create(name="broken", cluster=cluster, role="colocated", model_version=version, replicas=1)
        ref = pool_ref(pool)
        backend.apply_pool_track(PoolTrackSpec(pool=ref, role="colocated", track="stable", replicas=1,
                                               model=ModelRef(name="no-such-model", version="v1"),
                                               env={"TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}))

        def dead(restarts):
            replicas = backend.observe(ref).tracks["stable"].replicas
            return len(replicas) == 1 and not replicas[0].alive and replicas[0].restart_count == restarts

        assert wait_for(lambda: dead(0), 120), backend.observe(ref)
        observed = backend.observe(ref)
        (replica,) = observed.tracks["stable"].replicas
        assert (replica.exit_code, replica.message) == (EXIT_MODEL_LOAD_FAILED, ERROR)
        replicas_refresh(pool=pool, observed=observed)
        row = Replica.objects.get(pool=pool)
        assert (row.alive, row.exit_code, row.message, row.exited_at is not None) == (False, 3, ERROR, True)
        (listed,) = viewer_api.get(f"/api/v1/replicas/?pool={pool.pk}").json()["results"]
        assert (listed["alive"], listed["exit_code"], listed["message"]) == (False, 3, ERROR)  # not only /health

        # First death: restart at once, the reason names the error.
        assert pool_converge(pool, observed, now_s=replica.exited_at) == "pool.restart_replica"
        first = Action.objects.get(kind="pool.restart_replica")
        assert first.params == {"replica": "broken-stable-0",
                                "reason": f"replica broken-stable-0 is not running (exit code 3): {ERROR}"}
        action_cancel(action=first)  # the test restarts it itself (what the Action's handler does)
        backend.restart_replica(ref, "broken-stable-0")
        assert wait_for(lambda: dead(1), 120), backend.observe(ref)
        observed = backend.observe(ref)
        (again,) = observed.tracks["stable"].replicas
        assert (again.exit_code, again.message) == (3, ERROR) and again.exited_at > replica.exited_at

        # Second death: 10 s of backoff from it; nothing before, a restart after.
        assert pool_converge(pool, observed, now_s=again.exited_at + 9.9) is None
        assert pool_converge(pool, observed, now_s=again.exited_at + 10) == "pool.restart_replica"
        second = Action.objects.filter(kind="pool.restart_replica").latest("id")
        assert second.params["reason"] == (f"replica broken-stable-0 is not running (exit code 3): {ERROR}; "
                                           "restart 2 after a backoff of 10s")
        assert Action.objects.filter(kind="pool.restart_replica").count() == 2
    finally:
        backend.close()
        agent.terminate()
