"""State machine: every verb from every state over the API (allowed -> new state, forbidden -> 409 naming
the state and the allowed verbs), abort during a pause, promote skipping steps, ending at 100%."""

from datetime import timedelta

import pytest

from apps.fleet.models import Pool, PoolTrack
from apps.operations.models import Action
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.models import RolloutPlan
from apps.rollouts.tests.conftest import drive, observe, table_version, table_weights
from apps.rollouts.transitions import STATES, VERBS, allowed_verbs, state_label

pytestmark = pytest.mark.django_db

STEPS = [{"set_weight": 33}, {"pause": {}}, {"set_weight": 66}, {"pause": {"seconds": 60}}]


@pytest.fixture
def decode3(make_pool):
    pool = make_pool("decode", role="colocated", replicas=3)
    observe(pool)
    return pool


def _plan(pool, target, steps=STEPS, **fields):
    return services.rollout_plan_create(pools=[pool], target_model_version=target, name="gemma v2",
                                        strategy="canary", steps=steps, **fields)


def _plan_in(state, pool, target):
    plan = _plan(pool, target)
    if state == "pending":
        return plan
    services.rollout_start(plan=plan)
    if state == "progressing":
        return plan
    if state == "paused":
        return services.rollout_pause(plan=plan)
    if state == "aborted":
        return services.rollout_abort(plan=plan)
    if state == "failed":
        RolloutPlan.objects.filter(pk=plan.pk).update(state="failed")
        return plan
    services.rollout_promote(plan=plan)
    drive(plan)
    return plan


EXPECTED = {  # (state, verb) -> state after; missing = 409
    ("pending", "start"): "progressing", ("pending", "abort"): "aborted",
    ("progressing", "pause"): "paused", ("progressing", "promote"): "progressing",
    ("progressing", "abort"): "aborted",
    ("paused", "resume"): "progressing", ("paused", "promote"): "progressing", ("paused", "abort"): "aborted",
    ("promoted", "rollback"): "promoted",
}


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_from_every_state(operator_api, decode3, v2, state, verb):
    plan = _plan_in(state, decode3, v2)
    plan.refresh_from_db()
    assert plan.state == state
    actions_before = Action.objects.filter(target_type="rollout", target_id=str(plan.pk)).count()
    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/{verb}/")
    plan.refresh_from_db()
    if (state, verb) in EXPECTED:
        assert r.status_code == (201 if verb == "rollback" else 200), r.json()
        assert plan.state == EXPECTED[(state, verb)]
        assert Action.objects.filter(target_type="rollout", target_id=str(plan.pk), kind=f"rollout.{verb}").exists()
        if verb == "rollback":
            back = RolloutPlan.objects.get(pk=r.json()["id"])
            assert (back.state, back.rollback_of_id, back.target_model_version.version) == ("progressing", plan.pk,
                                                                                             "v1")
    else:
        assert r.status_code == 409
        allowed = allowed_verbs(state)
        hint = f"allowed: {', '.join(allowed)}" if allowed else "no verb is allowed in this state"
        if verb == "abort" and plan.typed_progress.cleanup:  # the way out of a cleanup still running: force
            assert r.json() == {"detail": f"Rollout 'gemma v2' is {state} and its cleanup is still running; abort "
                                          'with {"force": true} removes the new-version tracks now.'}
        else:
            assert r.json() == {"detail": f"Rollout 'gemma v2' is {state}; cannot {verb} ({hint})."}
        assert plan.state == state
        assert Action.objects.filter(target_type="rollout", target_id=str(plan.pk)).count() == actions_before


def test_viewer_cannot_use_verbs(viewer_api, decode3, v2):
    plan = _plan(decode3, v2)
    assert viewer_api.post(f"/api/v1/rollouts/{plan.pk}/start/").status_code == 403


def test_abort_during_pause_returns_traffic_at_once_and_next_tick_does_not_advance(operator_api, decode3, v2):
    plan = _plan(decode3, v2)
    services.rollout_start(plan=plan)
    drive(plan, until=("paused",))
    assert table_weights() == {"canary": ("v2", 33), "stable": ("v1", 67)}
    assert {t.name: t.replicas for t in decode3.tracks.all()} == {"stable": 2, "canary": 1}
    index = RolloutPlan.objects.get(pk=plan.pk).current_step_index
    assert index == 2
    version = table_version()

    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/abort/")
    assert (r.status_code, r.json()["state"]) == (200, "aborted")
    assert table_weights() == {"canary": ("v2", 0), "stable": ("v1", 100)}  # before any tick
    assert table_version() == version + 1

    steps_before = Action.objects.filter(kind="rollout.step", target_id=str(plan.pk)).count()
    observe(decode3)
    for _ in range(3):
        rollout_tick(rollout_id=plan.pk, step_index=index)
        observe(decode3)
    plan.refresh_from_db()
    assert (plan.state, plan.current_step_index) == ("aborted", index)
    assert Action.objects.filter(kind="rollout.step", target_id=str(plan.pk)).count() == steps_before
    assert {t.name: (t.replicas, t.weight) for t in decode3.tracks.all()} == {"stable": (3, 100)}
    assert table_weights() == {"stable": ("v1", 100)}
    assert rollout_tick(rollout_id=plan.pk) == "skipped"


def test_promote_skips_remaining_steps_and_ends_on_the_new_version(decode3, v2):
    plan = _plan(decode3, v2)
    services.rollout_start(plan=plan)
    drive(plan, until=("paused",))
    services.rollout_promote(plan=plan)
    drive(plan)
    plan.refresh_from_db()
    applied = sorted(a.params["step_index"] for a in Action.objects.filter(kind="rollout.step", target_id=str(plan.pk))
                     if "step_index" in a.params)
    assert applied == [0, 1]  # steps 2 and 3 never ran
    assert (plan.state, plan.current_step_index) == ("promoted", 4)
    decode3 = Pool.objects.get(pk=decode3.pk)
    assert decode3.model_version.version == "v2"
    assert [(t.name, t.model_version.version, t.replicas, t.weight) for t in PoolTrack.objects.filter(pool=decode3)] == [
        ("stable", "v2", 3, 100)]
    assert table_weights() == {"stable": ("v2", 100)}


def test_plan_whose_last_weight_is_below_100_still_ends_at_100(decode3, v2):
    plan = _plan(decode3, v2, steps=[{"set_weight": 50}])
    services.rollout_start(plan=plan)
    drive(plan)
    kinds = [(a.kind, a.params) for a in Action.objects.filter(target_id=str(plan.pk)).order_by("id")]
    assert ("rollout.step", {"phase": "canary", "weight": 100}) in kinds
    assert ("rollout.step", {"phase": "finalize", "weight": 100}) in kinds
    assert kinds[-1][0] == "rollout.complete"
    assert [(t.name, t.model_version.version, t.replicas) for t in decode3.tracks.all()] == [("stable", "v2", 3)]


def test_rollback_after_promotion_goes_back_to_the_previous_version(operator_api, decode3, v2):
    plan = _plan(decode3, v2, steps=[{"set_weight": 100}])
    services.rollout_start(plan=plan)
    drive(plan)
    r = operator_api.post(f"/api/v1/rollouts/{plan.pk}/rollback/")
    assert r.status_code == 201, r.json()
    back = RolloutPlan.objects.get(pk=r.json()["id"])
    assert r.json()["state_label"] == "rolling back"
    drive(back)
    assert Pool.objects.get(pk=decode3.pk).model_version.version == "v1"
    assert table_weights() == {"stable": ("v1", 100)}
    # A rollback reads as one: the machine's state stays promoted, its label and message say rolled back.
    body = operator_api.get(f"/api/v1/rollouts/{back.pk}/").json()
    v1 = plan.stable_model_version
    assert (body["state"], body["state_label"], body["message"]) == (
        "promoted", "rolled back", f"Rolled back: every pool runs {v1} again (rollback of rollout #{plan.pk}).")
    body = operator_api.get(f"/api/v1/rollouts/{plan.pk}/").json()
    assert (body["state"], body["state_label"], body["message"]) == ("promoted", "promoted",
                                                                     f"Promoted: every pool runs {v2}.")


def test_state_labels_name_a_rollback_rollout_by_what_it_does():
    assert [state_label(s, is_rollback=False) for s in STATES] == list(STATES)
    assert [state_label(s, is_rollback=True) for s in STATES] == [
        "rollback pending", "rolling back", "rollback paused", "rolled back", "rollback aborted", "rollback failed"]


def test_progress_deadline_fails_the_rollout_and_returns_traffic(decode3, v2):
    plan = _plan(decode3, v2, steps=[{"set_weight": 33}, {"set_weight": 66}], progress_deadline_s=5)
    services.rollout_start(plan=plan)
    assert rollout_tick(rollout_id=plan.pk) == "set_weight"  # step 0: one canary desired
    observe(decode3)
    assert rollout_tick(rollout_id=plan.pk) == "set_weight"  # step 0 settled at 33%; step 1 wants 2 canaries
    observe(decode3, tracks=("stable",))  # ... but the second canary never becomes ready
    plan.refresh_from_db()
    assert rollout_tick(rollout_id=plan.pk, now=plan.step_started_at + timedelta(seconds=4)) == "waiting"
    assert rollout_tick(rollout_id=plan.pk, now=plan.step_started_at + timedelta(seconds=6)) == "failed"
    plan.refresh_from_db()
    assert plan.state == "failed"
    assert plan.message == ("progress deadline of 5s exceeded while waiting for dc-a/decode canary: 1 of 2 replicas "
                            "ready")
    assert table_weights() == {"canary": ("v2", 0), "stable": ("v1", 100)}
    fail = Action.objects.get(kind="rollout.fail", target_id=str(plan.pk))
    assert (fail.status, fail.error) == ("failed", plan.message)
