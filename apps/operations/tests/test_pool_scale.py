"""``POST /api/v1/pools/{id}/scale/``: creates a pending Action, one per pool at a time, idempotent by key."""

import pytest

from apps.operations.models import Action
from apps.operations.services import action_cancel

pytestmark = pytest.mark.django_db


def test_scale_creates_pending_action_and_enqueues_after_commit(operator_api, pool,
                                                                django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        r = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 5}, format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert (body["kind"], body["status"], body["params"], body["pool"]) == ("pool.scale", "pending", {"replicas": 5},
                                                                            pool.pk)
    assert (body["target_type"], body["target_id"], body["requested_by"]) == ("pool", str(pool.pk), "otto")
    assert len(callbacks) == 1  # execute_action is sent only once the row is committed
    action = Action.objects.get()
    assert action.lease_expires_at is None and action.started_at is None
    pool.refresh_from_db()
    assert pool.replicas == 2  # desired state changes when the Action runs


def test_scale_with_a_field_it_does_not_take_is_a_400_and_scales_nothing(operator_api, pool):
    """``{"replicas": 3, "track": "canary"}`` scaled the whole pool to 3, the track dropped without a word."""
    r = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 3, "track": "canary"}, format="json")
    assert (r.status_code, r.json()) == (400, {"track": ["Unknown field: it is not part of this resource."]})
    assert Action.objects.count() == 0


def test_second_scale_while_action_pending_is_409(operator_api, pool):
    first = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 5}, format="json")
    r = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 6}, format="json")
    assert r.status_code == 409
    assert r.json()["detail"] == (f"Pool dc-a/decode already has action #{first.json()['id']} (pool.scale, pending); "
                                  "wait for it to finish or cancel it, then retry.")
    action_cancel(action=Action.objects.get())
    assert operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 6}, format="json").status_code == 201


def test_same_idempotency_key_twice_returns_the_first_action(operator_api, pool):
    headers = {"HTTP_IDEMPOTENCY_KEY": "scale-7f3a"}
    r1 = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 4}, format="json", **headers)
    r2 = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 4}, format="json", **headers)
    assert (r1.status_code, r2.status_code) == (201, 200)
    assert r1.json() == r2.json()
    assert Action.objects.count() == 1
    assert Action.objects.get().idempotency_key == "scale-7f3a"
    other = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 9}, format="json", **headers)
    assert other.status_code == 409
    assert "already used for a different request" in other.json()["detail"]


@pytest.mark.parametrize("replicas", [-1, 10_001, "three", None])
def test_scale_rejects_bad_replicas(operator_api, pool, replicas):
    r = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": replicas}, format="json")
    assert r.status_code == 400
    assert "replicas" in r.json()
    assert Action.objects.count() == 0


def test_scale_outside_autoscaling_bounds_is_400(operator_api, make_pool):
    pool = make_pool(autoscaling_enabled=True, min_replicas=1, max_replicas=4)
    r = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 5}, format="json")
    assert r.status_code == 400
    assert r.json()["replicas"] == ["Autoscaling keeps this pool within 1..4 replicas; change min/max or disable "
                                    "autoscaling first."]


def test_invalid_idempotency_key_is_400(operator_api, pool):
    r = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 1}, format="json",
                          HTTP_IDEMPOTENCY_KEY="has spaces")
    assert r.status_code == 400 and "idempotency_key" in r.json()


def test_viewer_cannot_scale(viewer_api, pool):
    r = viewer_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 1}, format="json")
    assert r.status_code == 403
    assert r.json()["detail"] == "This request needs the operator role; you have viewer."


def test_pool_with_pending_action_cannot_be_deleted(admin_api, operator_api, pool):
    operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 3}, format="json")
    r = admin_api.delete(f"/api/v1/pools/{pool.pk}/")
    assert r.status_code == 409
    assert "wait or cancel it first" in r.json()["detail"]


def test_a_pool_delete_action_names_who_deleted_the_pool(admin_api, operator_api, pool):
    """Regression: the pool.delete Action of an API delete said "requested by system"."""
    from apps.operations.models import Action

    scaled = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 1}, format="json").json()
    Action.objects.filter(pk=scaled["id"]).update(status="succeeded")
    assert admin_api.delete(f"/api/v1/pools/{pool.pk}/").status_code == 204
    action = Action.objects.get(kind="pool.delete")
    assert action.requested_by == admin_api.user and action.log[0]["message"] == f"requested by {admin_api.user}"


@pytest.mark.django_db(transaction=True)
def test_concurrent_scale_requests_create_exactly_one_action(pool):
    """Two writers racing on one pool: the row lock / partial unique index lets exactly one through."""
    import threading

    from django.db import connection

    from apps.core.errors import ConflictError
    from apps.operations.pools import pool_scale

    barrier, outcomes = threading.Barrier(2), []

    def scale(replicas):
        try:
            barrier.wait()
            pool_scale(pool=pool, replicas=replicas)
            outcomes.append("created")
        except ConflictError:
            outcomes.append("conflict")
        finally:
            connection.close()

    threads = [threading.Thread(target=scale, args=(n,)) for n in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict", "created"]
    assert Action.objects.filter(pool=pool, status="pending").count() == 1
