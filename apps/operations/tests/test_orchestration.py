"""Execution, reconcile and the routing table in one process: Actions run by the task (eagerly) against
the Kubernetes backend on kmock's emulator over real HTTP, with a fake controller for readiness."""

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.fleet.models import PoolTrack, Replica
from apps.fleet.services import routing_table_publish
from apps.operations import handlers, services
from apps.operations.models import Action
from apps.operations.pools import pool_delete, pool_scale
from apps.operations.reconcile import reconcile_all
from apps.operations.tasks import execute_action
from apps.operations.tracks import split_replicas
from apps.orchestrators.base import BackendUnavailable, InvalidSpec
from apps.orchestrators.tests.kube_mock import DEPLOYMENTS
from inference_worker.router.table import RoutingTable as RouterTable

from .conftest import NS

pytestmark = pytest.mark.django_db


def run(action):
    return execute_action.apply(args=[action.pk]).get()


def scale_patches(kube, name="decode-a-stable"):
    return kube.requests("PATCH", f"/deployments/{name}/scale")


def test_scale_action_on_kubernetes_ends_with_the_right_deployment_replicas(kube, kube_controller, k8s_pool):
    action, _ = pool_scale(pool=k8s_pool, replicas=3)
    assert run(action) == "succeeded"
    action.refresh_from_db()
    deployment = kube.obj(DEPLOYMENTS, NS, "decode-a-stable")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["status"]["readyReplicas"] == 3
    assert (action.status, action.attempts, action.retryable) == ("succeeded", 1, None)
    assert [line["message"] for line in action.log][-3:] == [
        "desired replicas stable=3", "ready: stable: 3/3 ready", "succeeded"]
    assert k8s_pool.tracks.get().replicas == 3
    # Re-running the handler (a takeover) writes nothing: the scale subresource already says 3.
    patches = len(scale_patches(kube))
    handlers.HANDLERS["pool.scale"](action)
    assert len(scale_patches(kube)) == patches


def test_retryable_backend_error_requeues_and_invalid_spec_fails_for_good(db, pool):
    calls = []

    def flaky(action):
        calls.append(action.attempts)
        if len(calls) == 1:
            raise BackendUnavailable("agent down")
        raise InvalidSpec("pool name too long")

    handlers.register("test.flaky")(flaky)
    try:
        action, _ = services.action_create(kind="test.flaky", target_type="pool", target_id=str(pool.pk), pool=pool)
        result = execute_action.apply(args=[action.pk])  # eager: Celery's retry re-runs it in place
        assert result.get(propagate=False) == "failed"
    finally:
        handlers.HANDLERS.pop("test.flaky")
    action.refresh_from_db()
    assert calls == [1, 2]
    assert (action.status, action.retryable, action.attempts) == ("failed", False, 2)
    assert action.error == "InvalidSpec: pool name too long"
    assert action.queued_at > action.started_at  # released with the retry's due time, not "now"
    messages = [line["message"] for line in action.log]
    assert "BackendUnavailable: agent down; retry 1/5 in 2s" in messages
    assert messages[-1] == "failed: InvalidSpec: pool name too long (not retryable)"


def test_expired_lease_is_taken_over_once_and_a_renewed_one_is_not(db, pool):
    action, _ = services.action_create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), pool=pool,
                                       params={"replicas": 1})
    assert services.action_claim(action_id=action.pk, lease_s=30, owner="w1")
    assert services.action_leases_take_over(now=timezone.now() + timedelta(seconds=10)) == []
    assert services.action_lease_renew(action_id=action.pk, owner="w1", lease_s=30)
    assert not services.action_lease_renew(action_id=action.pk, owner="someone-else", lease_s=30)
    later = timezone.now() + timedelta(seconds=31)
    assert services.action_leases_take_over(now=later) == [action.pk]
    assert services.action_leases_take_over(now=later) == []  # a second tick finds nothing
    action.refresh_from_db()
    assert (action.status, action.lease_owner) == ("pending", "")
    assert "taken over by reconcile" in action.log[-1]["message"]
    assert not services.action_finish(action_id=action.pk, succeeded=True, owner="w1")  # the old owner lost it


def test_split_replicas_keeps_proportions_and_sums_exactly(model_version):
    def tracks(**replicas):
        return [PoolTrack(name=n, replicas=r, weight=50, model_version=model_version) for n, r in replicas.items()]

    assert split_replicas(5, tracks(stable=1)) == {"stable": 5}
    assert split_replicas(7, tracks(stable=3, canary=1)) == {"canary": 2, "stable": 5}
    assert split_replicas(3, tracks(stable=0, canary=0)) == {"canary": 2, "stable": 1}
    assert split_replicas(0, tracks(stable=4, canary=4)) == {"canary": 0, "stable": 0}


def test_reconcile_applies_a_never_applied_pool_then_is_idle(kube, kube_controller, k8s_pool, pool):
    # ``pool`` sits on a local cluster whose agent is not running: reconcile counts it unreachable.
    first = reconcile_all()
    assert (first.applies, first.pools_observed) == (1, 1)
    assert first.pools_unreachable == 1
    action = Action.objects.get(kind="pool.apply")
    assert action.params["reason"] == "stable: missing in the backend (desired 1)"
    again = reconcile_all()  # the Action is still pending: the same tick does nothing twice
    assert again.applies == 0 and Action.objects.filter(kind="pool.apply").count() == 1
    assert run(action) == "succeeded"
    settled = reconcile_all()
    assert settled.applies == 0 and settled.restarts == 0
    replica = Replica.objects.get(pool=k8s_pool)
    assert (replica.track, replica.ready, replica.alive, replica.version) == ("stable", True, True, "v1")
    assert replica.endpoint.startswith("http://10.0.0.") and replica.endpoint.endswith(":8000")
    k8s_pool.cluster.refresh_from_db()
    pool.cluster.refresh_from_db()
    assert (k8s_pool.cluster.status, pool.cluster.status) == ("ready", "unknown")


def test_routing_table_version_changes_only_with_content_and_parses_in_the_router(kube, kube_controller, k8s_pool):
    run(pool_scale(pool=k8s_pool, replicas=2)[0])
    reconcile_all()
    table, changed = routing_table_publish()
    assert not changed  # reconcile published this content already
    data = {"version": table.version, **table.content}
    parsed = RouterTable.from_dict(data)
    assert [(t.name, t.model_version, t.weight) for t in parsed.tracks] == [("stable", "v1", 100.0)]
    assert sorted(r.pool for r in parsed.replicas) == ["decode-a", "decode-a"]
    assert parsed.models["v1"].num_kv_heads == 1
    run(pool_scale(pool=k8s_pool, replicas=1)[0])
    result = reconcile_all()
    assert (result.routing_table_changed, result.routing_table_version) == (True, table.version + 1)


def test_routing_table_api_service_token_etag_and_304(client, settings, viewer_api, kube, kube_controller, k8s_pool):
    settings.FERRY_SERVICE_TOKEN = "svc-token-123"
    assert client.get("/api/v1/routing-table/").status_code == 401
    assert client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    r = client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION="Bearer svc-token-123")
    assert r.status_code == 200
    assert r.json()["version"] == 1 and r.json()["pools"][0]["replicas"] == []
    etag = r["ETag"]
    same = client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION="Bearer svc-token-123", HTTP_IF_NONE_MATCH=etag)
    assert (same.status_code, same["ETag"]) == (304, etag)
    assert viewer_api.get("/api/v1/routing-table/").status_code == 200
    run(pool_scale(pool=k8s_pool, replicas=1)[0])
    reconcile_all()
    changed = client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION="Bearer svc-token-123",
                         HTTP_IF_NONE_MATCH=etag)
    assert changed.status_code == 200 and changed["ETag"] != etag
    assert changed.json()["version"] == 2 and len(changed.json()["pools"][0]["replicas"]) == 1


def test_service_group_user_token_reads_the_routing_table(client, db):
    from django.contrib.auth.models import Group, User

    from apps.accounts.services import api_token_create

    user = User.objects.create_user("router-sa")
    user.groups.add(Group.objects.get_or_create(name="service")[0])
    token = api_token_create(user=user)
    assert client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    plain = User.objects.create_user("nobody")
    other = api_token_create(user=plain)
    assert client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION=f"Bearer {other}").status_code == 403
    assert client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION=f"Bearer {other[:-1]}x").status_code == 401


def test_replicas_api_is_read_only_filtered_and_feeds_telemetry(viewer_api, admin_api, kube, kube_controller,
                                                                k8s_pool, django_assert_max_num_queries):
    run(pool_scale(pool=k8s_pool, replicas=2)[0])
    reconcile_all()
    with django_assert_max_num_queries(6):
        body = viewer_api.get(f"/api/v1/replicas/?pool={k8s_pool.pk}&ready=true").json()
    assert body["count"] == 2
    assert {r["pool_name"] for r in body["results"]} == {"decode-a"}
    assert viewer_api.get("/api/v1/replicas/?ready=false").json()["count"] == 0
    assert admin_api.post("/api/v1/replicas/", {}, format="json").status_code == 405
    from apps.telemetry.endpoints import replica_endpoints

    endpoints = replica_endpoints()
    assert sorted(e.replica for e in endpoints) == sorted(r["name"] for r in body["results"])
    assert {e.pool_id for e in endpoints} == {str(k8s_pool.pk)}


def test_deleting_a_pool_tears_its_tracks_down_through_an_action(kube, kube_controller, k8s_pool):
    run(pool_scale(pool=k8s_pool, replicas=1)[0])
    action = pool_delete(pool=k8s_pool)
    assert (action.kind, action.params["pool_name"], action.params["tracks"]) == ("pool.delete", "decode-a",
                                                                                  ["stable"])
    assert run(action) == "succeeded"
    assert kube.obj(DEPLOYMENTS, NS, "decode-a-stable") is None
