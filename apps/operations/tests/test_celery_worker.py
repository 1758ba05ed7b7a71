"""Celery with a real worker process on Redis: a duplicate delivery runs once; a worker SIGKILLed
mid-action leaves a lease that reconcile takes over, applied once; a second scale on a busy pool is 409.

The backend is Kubernetes on kmock's emulator (in this process, over real HTTP); the fake controller's
readiness delay keeps the Action waiting for ready replicas long enough to kill the worker mid-action.
"""

import time

import pytest

from apps.operations.models import Action
from apps.operations.reconcile import reconcile_all
from apps.operations.tasks import execute_action
from apps.orchestrators.tests.kube_mock import DEPLOYMENTS
from inference_worker.tests.support.agent import wait_for

from .celery_worker import CeleryWorker, purge_queues
from .conftest import NS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LEASE_S = 3
WORKER_ENV = {"FERRY_ACTION_LEASE_S": str(LEASE_S), "FERRY_ACTION_READY_TIMEOUT_S": "60"}


@pytest.fixture
def worker(tmp_path):
    purge_queues()
    holder = {"worker": CeleryWorker(tmp_path, WORKER_ENV).start()}
    yield holder
    holder["worker"].stop()


def status_of(action_id):
    return Action.objects.get(pk=action_id).status


def stable_deployment(kube):
    return kube.obj(DEPLOYMENTS, NS, "decode-a-stable")


def test_one_action_delivered_twice_runs_once(worker, kube, kube_controller, k8s_pool, operator_api):
    r = operator_api.post(f"/api/v1/pools/{k8s_pool.pk}/scale/", {"replicas": 2}, format="json")
    assert r.status_code == 201  # committed, so the first delivery is already on its way
    action_id = r.json()["id"]
    execute_action.apply_async(args=[action_id])  # the duplicate (what Redis redelivery looks like)
    assert wait_for(lambda: status_of(action_id) == "succeeded", 60), Action.objects.get(pk=action_id).log
    assert wait_for(lambda: "'skipped'" in worker["worker"].log(), 30), worker["worker"].log()[-2000:]
    action = Action.objects.get(pk=action_id)
    assert action.attempts == 1
    assert [line["message"] for line in action.log].count("attempt 1 started") == 1
    deployment = kube.obj(DEPLOYMENTS, NS, "decode-a-stable")
    assert (deployment["spec"]["replicas"], deployment["status"]["readyReplicas"]) == (2, 2)


def test_sigkill_mid_action_is_taken_over_by_reconcile_and_applied_once(worker, kube, kube_controller, k8s_pool,
                                                                       operator_api, tmp_path):
    first = operator_api.post(f"/api/v1/pools/{k8s_pool.pk}/scale/", {"replicas": 1}, format="json").json()
    assert wait_for(lambda: status_of(first["id"]) == "succeeded", 60)  # the track exists, 1 ready
    kube_controller.ready_delay_s = 10.0  # new pods take 10 s to become ready: the Action waits
    r = operator_api.post(f"/api/v1/pools/{k8s_pool.pk}/scale/", {"replicas": 3}, format="json")
    action_id = r.json()["id"]
    # a track Action applies the track's whole spec (apps.operations.tracks): the Deployment asks for 3 replicas
    assert wait_for(lambda: status_of(action_id) == "running" and stable_deployment(kube)["spec"]["replicas"] == 3, 30)
    generation = stable_deployment(kube)["metadata"]["generation"]

    busy = operator_api.post(f"/api/v1/pools/{k8s_pool.pk}/scale/", {"replicas": 5}, format="json")
    assert busy.status_code == 409
    assert busy.json()["detail"].startswith(f"Pool k8s-a/decode-a already has action #{action_id} (pool.scale, "
                                            "running)")

    worker["worker"].kill()
    killed_at = time.monotonic()
    assert status_of(action_id) == "running"  # nobody finished it: the lease is all that is left
    assert reconcile_all().taken_over == 0  # the lease has not expired yet
    time.sleep(max(0.0, LEASE_S + 1 - (time.monotonic() - killed_at)))
    worker["worker"] = CeleryWorker(tmp_path, WORKER_ENV).start()
    assert reconcile_all().taken_over == 1
    assert wait_for(lambda: status_of(action_id) == "succeeded", 60), Action.objects.get(pk=action_id).log

    action = Action.objects.get(pk=action_id)
    messages = [line["message"] for line in action.log]
    assert action.attempts == 2
    assert any("taken over by reconcile" in m for m in messages)
    assert messages[-2:] == ["ready: stable: 3/3 ready", "succeeded"]
    deployment = kube.obj(DEPLOYMENTS, NS, "decode-a-stable")
    assert (deployment["spec"]["replicas"], deployment["status"]["readyReplicas"]) == (3, 3)
    # the takeover found 3 already applied: the same spec again changes nothing (no new generation, no rollout)
    assert deployment["metadata"]["generation"] == generation
    assert k8s_pool.tracks.get().replicas == 3
