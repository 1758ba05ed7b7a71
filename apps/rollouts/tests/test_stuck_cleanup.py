"""Rollouts that used to be stuck after an abort or a failure (issue 20), with the fake observer.

* A canary that never becomes ready: after the progress deadline the rollout is ``failed``, the cleanup
  removes the canary (an unready replica is the first to go) and a new rollout can start on the pool.
* Force cleanup (``POST /api/v1/rollouts/{id}/abort/ {"force": true}``): when the ordinary revert cannot
  converge (the stable track has no ready replica, so traffic cannot go back to it), the new-version tracks
  are removed at once, recorded as Actions; allowed on an aborted or failed rollout whose cleanup is pending.
* A finished cleanup leaves the phase at none, not ``reverting``.
"""

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.fleet.models import PoolTrack, Replica
from apps.operations.models import Action
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.models import RolloutPlan
from apps.rollouts.tests.conftest import drive, observe, table_weights

pytestmark = pytest.mark.django_db


@pytest.fixture
def decode3(make_pool):
    pool = make_pool("decode", role="colocated", replicas=3)
    observe(pool)
    return pool


def _never_ready(pool, track="canary"):
    """Observe ``track``'s desired replicas as running but not ready (a worker that never becomes ready)."""
    desired = PoolTrack.objects.get(pool=pool, name=track)
    for i in range(desired.replicas):
        Replica.objects.update_or_create(pool=pool, name=f"{pool.name}-{track}-{i}", defaults={
            "track": track, "ready": False, "alive": True, "version": desired.model_version.version,
            "last_seen": timezone.now()})
    Replica.objects.filter(pool=pool, track=track).exclude(
        name__in=[f"{pool.name}-{track}-{i}" for i in range(desired.replicas)]).delete()


def _tracks(pool):
    return {t.name: (t.replicas, t.weight) for t in PoolTrack.objects.filter(pool=pool)}


def _fail_at_deadline(pool, v2):
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="never ready", strategy="canary",
                                        steps=[{"set_weight": 33}, {"pause": {}}], progress_deadline_s=5)
    services.rollout_start(plan=plan)
    assert rollout_tick(rollout_id=plan.pk) == "set_weight"
    observe(pool, tracks=("stable",))
    _never_ready(pool)
    plan.refresh_from_db()
    assert rollout_tick(rollout_id=plan.pk, now=plan.step_started_at + timedelta(seconds=6)) == "failed"
    plan.refresh_from_db()
    assert (plan.state, plan.phase, plan.progress["cleanup"]) == ("failed", "reverting", True)
    assert plan.message == "progress deadline of 5s exceeded while waiting for dc-a/decode canary: 0 of 1 replica ready"
    # the failing tick already took the canary to 0 (it serves nothing) and gave stable its total back
    assert _tracks(pool) == {"stable": (3, 100), "canary": (0, 0)}
    return plan


def test_a_canary_that_never_becomes_ready_is_removed_after_the_deadline_and_a_new_rollout_starts(
        operator_api, decode3, v2):
    plan = _fail_at_deadline(decode3, v2)
    outcomes = []
    for _ in range(6):
        observe(decode3, tracks=("stable",))
        _never_ready(decode3) if PoolTrack.objects.filter(pool=decode3, name="canary").exists() else None
        plan.refresh_from_db()
        if not plan.progress["cleanup"]:
            break
        outcomes.append(rollout_tick(rollout_id=plan.pk, now=plan.next_step_at + timedelta(milliseconds=1)))
    plan.refresh_from_db()
    assert outcomes == ["reverted"]  # stable ready, canary at 0: the canary track is removed
    assert (plan.state, plan.phase, plan.progress["cleanup"]) == ("failed", "", False)
    assert _tracks(decode3) == {"stable": (3, 100)}
    assert table_weights() == {"stable": ("v1", 100)}
    delete = Action.objects.get(kind="pool.track_delete", target_id=str(decode3.pk))
    assert (delete.params["track"], delete.params["requester"]) == ("canary", f"rollout:{plan.pk}")

    r = operator_api.post("/api/v1/rollouts/", {"name": "again", "pools": [decode3.pk], "target_model_version": v2.pk,
                                                "strategy": "canary", "steps": [{"set_weight": 100}]}, format="json")
    assert r.status_code == 201, r.json()
    r = operator_api.post(f"/api/v1/rollouts/{r.json()['id']}/start/")
    assert (r.status_code, r.json()["state"]) == (200, "progressing")


def test_force_abort_removes_the_new_tracks_whatever_their_readiness(operator_api, decode3, v2):
    plan = services.rollout_plan_create(pools=[decode3], target_model_version=v2, name="stuck", strategy="canary",
                                        steps=[{"set_weight": 33}, {"pause": {}}])
    services.rollout_start(plan=plan)
    drive(plan, until=("paused",))
    assert _tracks(decode3) == {"stable": (2, 67), "canary": (1, 33)}
    Replica.objects.filter(pool=decode3, track="stable").update(ready=False)  # stable lost its ready replicas

    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/abort/")  # the ordinary abort cannot move traffic back
    assert (r.status_code, r.json()["state"], r.json()["phase"]) == (200, "aborted", "reverting")
    assert table_weights() == {"canary": ("v2", 33), "stable": ("v1", 67)}
    for _ in range(3):
        plan.refresh_from_db()
        assert rollout_tick(rollout_id=plan.pk, now=plan.next_step_at + timedelta(milliseconds=1)) == "reverting"
    assert PoolTrack.objects.filter(pool=decode3, name="canary").exists()

    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/abort/", {"force": True}, format="json")
    assert (r.status_code, r.json()["state"], r.json()["phase"]) == (200, "aborted", ""), r.json()
    plan.refresh_from_db()
    assert plan.progress["cleanup"] is False
    assert plan.message.endswith("Forced cleanup: new-version tracks removed.")
    assert _tracks(decode3) == {"stable": (3, 100)}
    assert table_weights() == {"stable": ("v1", 100)}
    forced = Action.objects.filter(kind="rollout.abort", target_id=str(plan.pk)).order_by("-id").first()
    assert (forced.params, forced.requested_by.username, forced.status) == ({"force": True}, "otto", "succeeded")
    assert [line["message"] for line in forced.log][2:] == [
        "dc-a/decode: stable takes all the traffic and 3 replica(s)",
        "dc-a/decode: canary track removed (1 ready replica(s))",
        f"force cleanup done: routing table v{forced.log[-1]['message'].rsplit('v', 1)[1]}"]
    delete = Action.objects.get(kind="pool.track_delete", target_id=str(decode3.pk))
    assert (delete.params, delete.status) == ({"track": "canary", "requester": f"rollout:{plan.pk}"}, "pending")
    assert rollout_tick(rollout_id=plan.pk) == "skipped"
    listed = operator_api.get("/api/v1/actions/", {"requester": f"rollout:{plan.pk}"}).json()["results"]
    assert {"rollout.start", "rollout.step", "pool.track_set", "pool.track_delete"} <= {a["kind"] for a in listed}
    assert {(a["requester"], a["requested_by"]) for a in listed} == {(f"rollout:{plan.pk}", None)}
    by_otto = operator_api.get("/api/v1/actions/", {"requester": "otto"}).json()["results"]
    assert [(a["kind"], a["params"]) for a in by_otto] == [("rollout.abort", {"force": True}), ("rollout.abort", {})]

    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/abort/", {"force": True}, format="json")
    assert (r.status_code, r.json()) == (409, {"detail": "Rollout 'stuck' is aborted and its cleanup is done: "
                                                         "nothing to force."})
    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/abort/", {"force": "yes please"}, format="json")
    assert (r.status_code, r.json()) == (400, {"force": ["Must be a valid boolean."]})


def test_force_abort_of_a_running_rollout_and_of_a_failed_one_whose_cleanup_waits(operator_api, decode3, v2):
    plan = _fail_at_deadline(decode3, v2)
    Replica.objects.filter(pool=decode3, track="stable").update(ready=False)
    plan.refresh_from_db()
    assert rollout_tick(rollout_id=plan.pk, now=plan.next_step_at + timedelta(milliseconds=1)) == "reverting"
    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/abort/", {}, format="json")  # the 409 names the way out
    assert (r.status_code, r.json()["detail"]) == (409, "Rollout 'never ready' is failed and its cleanup is still "
                                                         'running; abort with {"force": true} removes the new-version '
                                                         "tracks now."), r.json()
    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/abort/", {"force": True}, format="json")
    assert (r.status_code, r.json()["state"], r.json()["phase"]) == (200, "failed", ""), r.json()
    assert _tracks(decode3) == {"stable": (3, 100)}

    running = services.rollout_plan_create(pools=[decode3], target_model_version=v2, name="running",
                                           strategy="canary", steps=[{"set_weight": 33}, {"pause": {}}])
    services.rollout_start(plan=running)
    observe(decode3)
    drive(running, until=("paused",))
    r = operator_api.post(f"/api/v1/rollouts/{running.pk}/abort/", {"force": True}, format="json")
    assert (r.status_code, r.json()["state"], r.json()["phase"]) == (200, "aborted", ""), r.json()
    assert _tracks(decode3) == {"stable": (3, 100)}
    kinds = list(Action.objects.filter(target_id=str(running.pk), target_type="rollout").order_by("id")
                 .values_list("kind", "params"))
    assert kinds[-1] == ("rollout.abort", {"force": True})
    assert [k for k, _ in kinds].count("rollout.abort") == 1  # one record for the abort and its forced cleanup
    assert RolloutPlan.objects.get(pk=running.pk).progress["cleanup"] is False
