"""Reconcile and the track Actions of ``apps.operations.tracks``: one writer per track at a time.

Regression (a canary v1 -> v2 promoted on ``make run``): the rollout's ``pool.track_delete`` of the canary was
still stopping its replicas when reconcile saw the canary "not desired" and created a ``pool.apply`` that
deleted the same replicas and failed. Reconcile now leaves a pool alone while a track Action on it is pending
or running. Kubernetes backend on kmock's emulator with the fake controller.
"""

import pytest

from apps.fleet.models import PoolTrack
from apps.operations import tracks
from apps.operations.models import Action
from apps.operations.reconcile import pool_busy, reconcile_all
from apps.operations.services import action_requester
from apps.operations.tasks import execute_action
from apps.orchestrators.tests.kube_mock import DEPLOYMENTS, PODS
from inference_worker.tests.support.agent import wait_for

from .conftest import NS

pytestmark = pytest.mark.django_db
WHO = "rollout:7"


def _pods(kube, track):
    return [obj for (resource, _, _), obj in list(kube.k.objects.items()) if resource == PODS and not obj.deleted
            and obj.raw["metadata"]["labels"].get("ferry.io/track") == track]


def test_reconcile_does_not_apply_a_pool_while_a_rollout_track_delete_is_pending_or_running(
        kube, kube_controller, k8s_pool, make_model_version):
    first = reconcile_all()  # the never-applied stable track
    apply = Action.objects.get(kind="pool.apply")
    assert (first.applies, apply.log[0]["message"], action_requester(apply)) == (
        1, "requested by reconcile", "reconcile")
    assert execute_action.apply(args=[apply.pk]).get() == "succeeded"
    canary, created = tracks.pool_track_create(pool=k8s_pool, name="canary", model_version=make_model_version("v2"),
                                               active=True, replicas=1, requester=WHO, idempotency_key="k-1")
    assert tracks.actions_execute(action_ids=[created.pk]) == {created.pk: "succeeded"}
    assert wait_for(lambda: len(_pods(kube, "stable")) == 1 and len(_pods(kube, "canary")) == 1, 10)

    deleted = tracks.pool_track_delete(track=canary, requester=WHO, idempotency_key="k-2")  # promote: canary goes
    assert not PoolTrack.objects.filter(pool=k8s_pool, name="canary").exists()
    assert kube.obj(DEPLOYMENTS, NS, "decode-a-canary") is not None  # the backend still runs it: "not desired"
    assert pool_busy(k8s_pool) is True
    pending = reconcile_all()
    Action.objects.filter(pk=deleted.pk).update(status=Action.Status.RUNNING)  # claimed, stopping replicas
    running = reconcile_all()
    assert (pending.applies, pending.pools_observed, running.applies, running.pools_observed) == (0, 1, 0, 1)
    assert Action.objects.filter(kind="pool.apply").count() == 1

    Action.objects.filter(pk=deleted.pk).update(status=Action.Status.PENDING)
    assert tracks.actions_execute(action_ids=[deleted.pk]) == {deleted.pk: "succeeded"}
    assert kube.obj(DEPLOYMENTS, NS, "decode-a-canary") is None
    assert pool_busy(k8s_pool) is False
    settled = reconcile_all()
    assert (settled.applies, settled.restarts, settled.pools_observed) == (0, 0, 1)
    assert list(Action.objects.filter(status="failed")) == []
    assert sorted(Action.objects.values_list("kind", "status")) == [
        ("pool.apply", "succeeded"), ("pool.track_delete", "succeeded"), ("pool.track_set", "succeeded")]


def test_a_finished_track_action_does_not_make_the_pool_busy(pool):
    action = tracks.pool_track_set(track=PoolTrack.objects.get(pool=pool, name="stable"), requester=WHO,
                                   idempotency_key="k-1", replicas=3)
    assert pool_busy(pool) is True
    for finished in Action.FINISHED_STATUSES:
        Action.objects.filter(pk=action.pk).update(status=finished)
        assert pool_busy(pool) is False
    Action.objects.create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), pool=pool, status="running")
    assert pool_busy(pool) is True
