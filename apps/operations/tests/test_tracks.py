"""Pool-track services (``apps.operations.tracks``): one Action per change with its requester, routing-only
changes recorded as done, idempotency keys, and the handlers against the Kubernetes API emulator."""

import pytest

from apps.core.errors import ConflictError
from apps.fleet.models import PoolTrack
from apps.operations import tracks
from apps.operations.models import Action
from apps.operations.reconcile import reconcile_all
from apps.operations.tasks import execute_action
from apps.orchestrators.tests.kube_mock import DEPLOYMENTS, PODS, SERVICES
from inference_worker.tests.support.agent import wait_for

from .conftest import NS

pytestmark = pytest.mark.django_db
WHO = "rollout:7"


def _messages(action):
    return [line["message"] for line in Action.objects.get(pk=action.pk).log]


def _stable(pool):
    return PoolTrack.objects.select_related("pool__cluster", "model_version").get(pool=pool, name="stable")


def test_a_replicas_change_writes_the_row_and_records_one_pending_action_with_its_requester(pool):
    track = _stable(pool)
    action = tracks.pool_track_set(track=track, requester=WHO, idempotency_key="k-1", replicas=3)
    assert PoolTrack.objects.get(pk=track.pk).replicas == 3
    assert (action.kind, action.status, action.pool_id, action.target_type, action.target_id) == (
        "pool.track_set", "pending", None, "pool", str(pool.pk))
    assert action.params == {"track": "stable", "changes": {"replicas": 3}, "requester": WHO}
    assert _messages(action) == ["requested by rollout:7"]
    assert Action.objects.count() == 1


def test_a_weight_change_reaches_no_backend_and_is_recorded_as_done(pool):
    action = tracks.pool_track_set(track=_stable(pool), requester=WHO, idempotency_key="k-1", weight=40)
    assert (action.status, action.params["changes"]) == ("succeeded", {"weight": 40})
    assert _messages(action) == ["requested by rollout:7", "routing table only (weight/active): no backend call"]


def test_no_change_records_no_action(pool):
    track = _stable(pool)
    assert tracks.pool_track_set(track=track, requester=WHO, idempotency_key="k-1", replicas=track.replicas,
                                 weight=track.weight) is None
    assert Action.objects.count() == 0


def test_a_repeated_key_returns_the_first_action_and_a_reused_key_for_another_change_is_refused(pool):
    first = tracks.pool_active_switch(pool=pool, track="green", requester=WHO, idempotency_key="k-9")
    again = tracks.pool_active_switch(pool=pool, track="green", requester=WHO, idempotency_key="k-9")
    assert first.pk == again.pk
    with pytest.raises(ConflictError, match="Idempotency-Key 'k-9' was already used for a different request"):
        tracks.pool_active_switch(pool=pool, track="blue", requester=WHO, idempotency_key="k-9")
    assert Action.objects.count() == 1


def test_no_pool_lock_so_a_busy_pool_still_takes_the_rollout_changes(pool):
    Action.objects.create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), pool=pool, status="running")
    action = tracks.pool_track_set(track=_stable(pool), requester=WHO, idempotency_key="k-1", replicas=1)
    assert action.status == "pending"


def test_track_set_handler_creates_then_scales_the_deployment(kube, k8s_pool, make_model_version):
    v2 = make_model_version("v2")
    canary, created = tracks.pool_track_create(pool=k8s_pool, name="canary", model_version=v2, active=True,
                                               requester=WHO, idempotency_key="k-1")
    assert created.params["changes"] == {"created": True, "replicas": 0, "weight": 0, "active": True,
                                         "model_version": "v2", "extra_args": ""}
    assert tracks.actions_execute(action_ids=[created.pk]) == {created.pk: "succeeded"}
    deployment = kube.obj(DEPLOYMENTS, NS, "decode-a-canary")
    assert deployment["spec"]["replicas"] == 0
    assert deployment["spec"]["template"]["metadata"]["labels"]["ferry.io/model-version"] == "v2"
    scaled = tracks.pool_track_set(track=canary, requester=WHO, idempotency_key="k-2", replicas=2)
    assert tracks.actions_execute(action_ids=[scaled.pk]) == {scaled.pk: "succeeded"}
    assert tracks.actions_execute(action_ids=[scaled.pk]) == {scaled.pk: "skipped"}  # a duplicate delivery
    assert kube.obj(DEPLOYMENTS, NS, "decode-a-canary")["spec"]["replicas"] == 2
    assert _messages(scaled)[-2:] == ["applied canary (2 replicas, v2)", "succeeded"]


def test_a_late_track_set_applies_the_row_as_it_is_now(kube, k8s_pool):
    stable = _stable(k8s_pool)
    first = tracks.pool_track_set(track=stable, requester=WHO, idempotency_key="k-1", replicas=3)
    tracks.pool_track_set(track=stable, requester=WHO, idempotency_key="k-2", replicas=2)
    tracks.actions_execute(action_ids=[first.pk])
    assert kube.obj(DEPLOYMENTS, NS, "decode-a-stable")["spec"]["replicas"] == 2


def test_track_delete_handler_deletes_unless_the_track_is_desired_again(kube, k8s_pool, make_model_version):
    v2 = make_model_version("v2")
    canary, created = tracks.pool_track_create(pool=k8s_pool, name="canary", model_version=v2, active=True,
                                               requester=WHO, idempotency_key="k-1")
    tracks.actions_execute(action_ids=[created.pk])
    deleted = tracks.pool_track_delete(track=canary, requester=WHO, idempotency_key="k-2")
    assert not PoolTrack.objects.filter(pool=k8s_pool, name="canary").exists()
    back, _ = tracks.pool_track_create(pool=k8s_pool, name="canary", model_version=v2, active=True, requester=WHO,
                                       idempotency_key="k-3")  # a later rollout wants it back before the delete ran
    assert tracks.actions_execute(action_ids=[deleted.pk]) == {deleted.pk: "succeeded"}
    assert _messages(deleted)[-2:] == ["track canary is desired again: not deleted", "succeeded"]
    assert kube.obj(DEPLOYMENTS, NS, "decode-a-canary") is not None
    again = tracks.pool_track_delete(track=back, requester=WHO, idempotency_key="k-4")
    assert tracks.actions_execute(action_ids=[again.pk]) == {again.pk: "succeeded"}
    assert kube.obj(DEPLOYMENTS, NS, "decode-a-canary") is None


def test_switch_active_handler_moves_the_service_and_reports_it(kube, k8s_pool, make_model_version):
    green, created = tracks.pool_track_create(pool=k8s_pool, name="green", model_version=make_model_version("v2"),
                                              active=False, requester=WHO, idempotency_key="k-1")
    stable = tracks.pool_track_set(track=_stable(k8s_pool), requester=WHO, idempotency_key="k-2", replicas=2)
    assert tracks.actions_execute(action_ids=[created.pk, stable.pk]) == {created.pk: "succeeded",
                                                                          stable.pk: "succeeded"}
    switch = tracks.pool_active_switch(pool=k8s_pool, track="green", requester=WHO, idempotency_key="k-3")
    assert tracks.actions_execute(action_ids=[switch.pk]) == {switch.pk: "succeeded"}
    assert kube.obj(SERVICES, NS, "decode-a")["spec"]["selector"]["ferry.io/track"] == "green"
    switch.refresh_from_db()
    assert tracks.switch_outcome(switch).startswith("switch_active(green) -> ")


def test_a_handler_for_a_deleted_pool_fails_with_a_clear_error(pool):
    action = tracks.pool_active_switch(pool=pool, track="green", requester=WHO, idempotency_key="k-1")
    Action.objects.filter(pk=action.pk).update(target_id="999999")
    assert tracks.actions_execute(action_ids=[action.pk]) == {action.pk: "failed"}
    assert Action.objects.get(pk=action.pk).error == "pool.switch_active: pool 999999 no longer exists"


def backend_apply(pool):
    """The never-applied pool's first ``pool.apply`` (reconcile's), run to completion."""
    reconcile_all()
    apply = Action.objects.get(kind="pool.apply", status="pending")
    assert execute_action.apply(args=[apply.pk]).get() == "succeeded"


def _pod_versions(kube, track):
    return sorted(obj.raw["metadata"]["labels"]["ferry.io/model-version"]
                  for (resource, _, _), obj in list(kube.k.objects.items())
                  if resource == PODS and not obj.deleted and obj.raw["metadata"]["labels"].get("ferry.io/track") == track)


@pytest.mark.parametrize("order", ["as recorded", "replicas first"])
def test_track_actions_run_in_any_order_leave_only_replicas_of_the_rows_version(
        kube, kube_controller, k8s_pool, make_model_version, order):
    """Regression (a canary finalize on Kubernetes stuck at "canary: 2 replicas, going to 0 once the replacements
    are ready"): the finalize writes the stable track's model version and then its replicas, two Actions that a
    worker may run in either order. A replicas-only Action that scaled the Deployment still templated with the
    old version started a v1 pod, which the later template change never replaced (no controller rolls a pod
    whose version the routing table does not expect here). Every ``pool.track_set`` now applies the row's
    whole spec, so the order does not matter."""
    stable = _stable(k8s_pool)
    backend_apply(k8s_pool)
    assert wait_for(lambda: _pod_versions(kube, "stable") == ["v1"], 10)
    emptied = tracks.pool_track_set(track=stable, requester=WHO, idempotency_key="k-1", replicas=0)
    assert tracks.actions_execute(action_ids=[emptied.pk]) == {emptied.pk: "succeeded"}
    assert wait_for(lambda: _pod_versions(kube, "stable") == [], 10)

    version = tracks.pool_track_set(track=stable, requester=WHO, idempotency_key="k-2",
                                    model_version=make_model_version("v2"))
    replicas = tracks.pool_track_set(track=stable, requester=WHO, idempotency_key="k-3", replicas=2)
    first, second = (version, replicas) if order == "as recorded" else (replicas, version)
    assert tracks.actions_execute(action_ids=[first.pk]) == {first.pk: "succeeded"}
    assert wait_for(lambda: len(_pod_versions(kube, "stable")) == 2, 10)  # the controller acted on the first
    assert tracks.actions_execute(action_ids=[second.pk]) == {second.pk: "succeeded"}
    assert _pod_versions(kube, "stable") == ["v2", "v2"]
    assert _messages(replicas)[-2:] == ["applied stable (2 replicas, v2)", "succeeded"]
