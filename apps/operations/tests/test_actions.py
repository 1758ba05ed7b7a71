"""Actions: services (idempotent create, retry, cancel), the execute_action task, and the API endpoints."""

import pytest

from apps.core.errors import ConflictError
from apps.fleet.models import PoolTrack
from apps.operations import handlers, tracks
from apps.operations.models import Action
from apps.operations.pools import pool_scale_by_system
from apps.operations.services import (
    EXECUTE_ACTION_TASK,
    action_cancel,
    action_claim,
    action_create,
    action_enqueue,
    action_finish,
    action_requester,
    action_retry,
)
from apps.operations.tasks import execute_action

pytestmark = pytest.mark.django_db


@pytest.fixture
def test_handlers():
    """Register handlers for test-only kinds and remove them afterwards."""
    calls = []

    def ok(action):
        calls.append(action.pk)

    def broken(action):
        raise handlers.ActionError("backend said no")

    handlers.register("test.ok")(ok)
    handlers.register("test.broken")(broken)
    yield calls
    handlers.HANDLERS.pop("test.ok")
    handlers.HANDLERS.pop("test.broken")


def _create(kind="test.ok", **kw):
    return action_create(kind=kind, target_type="pool", target_id="1", params={"n": 1}, **kw)[0]


def test_execute_action_claims_runs_and_a_duplicate_delivery_does_nothing(test_handlers):
    action = _create()
    assert execute_action.apply(args=[action.pk]).get() == "succeeded"
    action.refresh_from_db()
    assert action.status == "succeeded"
    assert action.started_at is not None and action.finished_at is not None and action.lease_expires_at is None
    assert [line["message"] for line in action.log] == ["requested by system", "attempt 1 started", "succeeded"]
    assert execute_action.apply(args=[action.pk]).get() == "skipped"
    assert test_handlers == [action.pk]


def test_enqueue_sends_the_execute_action_task_by_its_registered_name(test_handlers, monkeypatch):
    from controlplane.celery import app

    assert app.tasks[EXECUTE_ACTION_TASK].run.__module__ == execute_action.run.__module__ == "apps.operations.tasks"
    monkeypatch.setitem(app.conf, "task_always_eager", True)  # run in place instead of through the broker
    action = _create()
    action_enqueue(action_id=action.pk)
    action.refresh_from_db()
    assert (action.status, action.queued_at is not None, test_handlers) == ("succeeded", True, [action.pk])


def test_handler_error_fails_the_action_with_its_message(test_handlers):
    action = _create("test.broken")
    assert execute_action.apply(args=[action.pk]).get() == "failed"
    action.refresh_from_db()
    assert (action.status, action.error) == ("failed", "backend said no")


def test_unknown_kind_fails_with_a_clear_error():
    action = _create("test.nothing")
    assert execute_action.apply(args=[action.pk]).get() == "failed"
    action.refresh_from_db()
    assert action.error == "no handler is registered for action kind 'test.nothing'"


def test_register_refuses_a_second_handler_for_a_kind(test_handlers):
    with pytest.raises(ValueError, match="already registered"):
        handlers.register("test.ok")(lambda action: None)


def test_idempotency_key_returns_first_action():
    a1, created1 = action_create(kind="test.ok", target_type="pool", target_id="1", idempotency_key="k1")
    a2, created2 = action_create(kind="test.ok", target_type="pool", target_id="1", idempotency_key="k1")
    assert (a1.pk, created1, created2) == (a2.pk, True, False)


def test_cancel_only_pending_and_retry_only_failed_or_cancelled():
    action = _create()
    with pytest.raises(ConflictError, match="Only failed or cancelled actions can be retried; #\\d+ is pending."):
        action_retry(action=action)
    action_cancel(action=action)
    assert action.status == "cancelled" and action.finished_at is not None
    with pytest.raises(ConflictError, match="Only pending actions can be cancelled"):
        action_cancel(action=action)
    retry, created = action_retry(action=action)
    assert (created, retry.status, retry.retry_of_id, retry.params) == (True, "pending", action.pk, {"n": 1})


def test_claim_is_conditional():
    action = _create()
    assert action_claim(action_id=action.pk, lease_s=30) is True
    assert action_claim(action_id=action.pk, lease_s=30) is False
    action.refresh_from_db()
    assert (action.lease_expires_at - action.started_at).total_seconds() == 30
    with pytest.raises(ConflictError):
        action_cancel(action=action)
    assert action_finish(action_id=action.pk, succeeded=False, error="boom") is True
    assert action_finish(action_id=action.pk, succeeded=True) is False


def test_api_lists_filters_retries_and_cancels(operator_api, viewer_api, pool):
    scale = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 4}, format="json").json()
    assert viewer_api.get("/api/v1/actions/?status=pending").json()["count"] == 1
    assert viewer_api.get("/api/v1/actions/?status=failed").json()["count"] == 0
    assert viewer_api.get(f"/api/v1/actions/?pool={pool.pk}&requested_by=otto").json()["count"] == 1
    assert viewer_api.post(f"/api/v1/actions/{scale['id']}/cancel/").status_code == 403
    assert operator_api.post(f"/api/v1/actions/{scale['id']}/retry/").status_code == 409
    r = operator_api.post(f"/api/v1/actions/{scale['id']}/cancel/")
    assert (r.status_code, r.json()["status"]) == (200, "cancelled")
    assert operator_api.post(f"/api/v1/actions/{scale['id']}/cancel/").status_code == 409
    r = operator_api.post(f"/api/v1/actions/{scale['id']}/retry/", HTTP_IDEMPOTENCY_KEY="retry-1")
    assert (r.status_code, r.json()["retry_of"], r.json()["status"]) == (201, scale["id"], "pending")
    again = operator_api.post(f"/api/v1/actions/{scale['id']}/retry/", HTTP_IDEMPOTENCY_KEY="retry-1")
    assert (again.status_code, again.json()["id"]) == (200, r.json()["id"])
    assert Action.objects.count() == 2


def test_actions_are_read_only_through_the_api(admin_api):
    assert admin_api.post("/api/v1/actions/", {"kind": "pool.scale"}, format="json").status_code == 405


def test_api_requester_names_the_user_autoscaler_rollout_reconcile_or_system_and_filters_on_it(
        operator_api, viewer_api, make_pool, django_assert_num_queries):
    first, second = make_pool("decode-a"), make_pool("decode-b")
    user = operator_api.post(f"/api/v1/pools/{first.pk}/scale/", {"replicas": 4}, format="json").json()["id"]
    auto, _ = pool_scale_by_system(pool=second, replicas=3, reason="queue depth", idempotency_key="a-1")
    stable = PoolTrack.objects.get(pool=first, name="stable")
    rollout = tracks.pool_track_set(track=stable, requester="rollout:7", idempotency_key="r-1", replicas=1).pk
    by_user = tracks.pool_track_set(track=stable, requester="otto", requested_by=operator_api.user,
                                    idempotency_key="u-1", replicas=5).pk
    reconcile, _ = action_create(kind="pool.apply", target_type="pool", target_id=str(first.pk), requester="reconcile")
    system, _ = action_create(kind="pool.apply", target_type="pool", target_id=str(second.pk))
    expected = {user: ("otto", "otto"), auto.pk: (None, "autoscaler"), rollout: (None, "rollout:7"),
                by_user: ("otto", "otto"), reconcile.pk: (None, "reconcile"), system.pk: (None, "system")}

    with django_assert_num_queries(2):  # token with user and role, the page (it fits: no COUNT): none per Action
        listed = viewer_api.get("/api/v1/actions/").json()
    assert {a["id"]: (a["requested_by"], a["requester"]) for a in listed["results"]} == expected
    for who in ("otto", "autoscaler", "rollout:7", "reconcile", "system"):
        found = viewer_api.get("/api/v1/actions/", {"requester": who}).json()["results"]
        assert sorted(a["id"] for a in found) == sorted(i for i, (_, r) in expected.items() if r == who)
    assert viewer_api.get("/api/v1/actions/", {"requester": "rollout:8"}).json()["count"] == 0
    assert viewer_api.get(f"/api/v1/actions/{rollout}/").json()["requester"] == "rollout:7"
    assert {a.pk: action_requester(a) for a in Action.objects.all()} == {i: r for i, (_, r) in expected.items()}
    cancelled = operator_api.post(f"/api/v1/actions/{user}/cancel/").json()  # one Action, not annotated
    assert (cancelled["requested_by"], cancelled["requester"]) == ("otto", "otto")


def test_schema_documents_the_requester_field_and_filter(viewer_api):
    schema = viewer_api.get("/api/v1/schema/?format=json").json()
    field = schema["components"]["schemas"]["Action"]["properties"]["requester"]
    assert (field["type"], field["readOnly"]) == ("string", True)
    assert field["description"].startswith("Who asked: a user's name, `autoscaler`, `rollout:<id>`")
    params = {p["name"]: p for p in schema["paths"]["/api/v1/actions/"]["get"]["parameters"]}
    assert params["requester"]["schema"] == {"type": "string"}
    assert params["requester"]["description"].startswith("Who asked (exact)")


def test_about_pool_lists_every_action_about_the_pool_a_rollouts_track_changes_included(
        viewer_api, pool, make_pool):
    """The pool page's "Recent actions" (``?about_pool=``): a rollout's ``pool.track_set``/``pool.track_delete``
    Actions target the pool without holding its lock, so ``?pool=`` (the lock) omitted them (a new user's report)."""
    other = make_pool("other")
    scale, _ = pool_scale_by_system(pool=pool, replicas=3, reason="queue depth", idempotency_key="as-1")
    stable = PoolTrack.objects.get(pool=pool, name="stable")
    track_set = tracks.pool_track_set(track=stable, weight=60, requester="rollout:7", idempotency_key="r7-w60")
    track_delete = tracks.pool_track_delete(track=PoolTrack.objects.create(
        pool=pool, name="canary", model_version=pool.model_version, replicas=0), requester="rollout:7",
        idempotency_key="r7-del")
    pool_scale_by_system(pool=other, replicas=3, reason="queue depth", idempotency_key="as-2")  # not listed
    listed = viewer_api.get(f"/api/v1/actions/?about_pool={pool.pk}").json()["results"]
    assert sorted((a["id"], a["kind"], a["requester"]) for a in listed) == [
        (scale.pk, "pool.scale", "autoscaler"), (track_set.pk, "pool.track_set", "rollout:7"),
        (track_delete.pk, "pool.track_delete", "rollout:7")]
    assert [a["id"] for a in viewer_api.get(f"/api/v1/actions/?pool={pool.pk}").json()["results"]] == [scale.pk]
    for bad in ("0", "9223372036854775808", "x"):
        response = viewer_api.get(f"/api/v1/actions/?about_pool={bad}")
        assert response.status_code == 400 and "about_pool" in response.json(), (bad, response.content)
