"""Operator messages of a rollout: fresh on every tick, one step-numbering convention, the right counts.

Regressions seen on the README demo: ``Waiting for dc-prefill/prefill canary: 0/1 ready (desired 1).`` stayed
shown for a minute while steps 1 -> 2 -> 3 advanced; ``canary: 1/0 ready (desired 1)`` put the target where
the ready count was expected to be read; the header said ``step 4``, the message ``Paused at step 3`` and the
log ``Resumed by operator at step 4`` (0- and 1-based mixed). Convention now: messages, log lines and error
texts say ``step N of M`` counting from 1; the API's ``current_step_index`` and ``step_index`` stay 0-based.
"""

from datetime import timedelta

import pytest

from apps.fleet.testing import router_for
from apps.operations.models import Action
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.tests.conftest import due_now, observe, table_version

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quick_agent")]


def _tick(plan, **kwargs):
    outcome = rollout_tick(rollout_id=plan.pk, now=due_now(plan) + timedelta(milliseconds=1), **kwargs)
    plan.refresh_from_db()
    return outcome, plan.message


def test_a_waiting_message_is_replaced_once_the_condition_is_gone(make_pool, v2):
    pool = make_pool("decode", role="colocated", replicas=2)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="c", strategy="canary",
                                        steps=[{"set_weight": 50}, {"pause": {"seconds": 5}}, {"set_weight": 100},
                                               {"pause": {}}])
    services.rollout_start(plan=plan)
    assert _tick(plan) == ("set_weight", "At step 1 of 4 (set weight 50%): canary weight 0% (target 50%).")
    assert _tick(plan) == ("waiting", "Waiting for dc-a/decode canary: 0 of 1 replica ready.")
    observe(pool)
    assert _tick(plan) == ("paused-timed", "At step 2 of 4 (pause 5 s): canary weight 50%.")
    assert _tick(plan) == ("set_weight", "At step 3 of 4 (set weight 100%): canary weight 50% (target 100%).")
    # one more canary starts, the stable replica waits for it
    assert _tick(plan) == ("waiting", "Waiting for dc-a/decode canary: 1 of 2 replicas ready.")
    observe(pool, tracks=("canary",))  # the second canary is up; the backend has not stopped stable yet
    assert _tick(plan) == ("waiting", "Waiting for dc-a/decode stable: 2 replicas still running (desired 0).")
    observe(pool)
    assert _tick(plan) == ("paused", "Paused at step 4 of 4 (pause until resumed) until resumed or promoted.")
    assert plan.current_step_index == 4  # the API field stays 0-based: the index of the next step


def test_every_tick_that_does_not_wait_clears_the_waiting_message(make_pool, v2, fake_http, settings):
    """Canary and blue-green with a router one tick behind: "Waiting for" is shown exactly on waiting ticks."""
    settings.FERRY_AGENT_TOKEN = "agent-token"
    seen = []
    for strategy, steps in (("canary", [{"set_weight": 50}, {"analysis": {}}, {"set_weight": 100}]),
                            ("blue_green", [{"pause": {"seconds": 1}}])):
        pool = make_pool(f"{strategy.replace('_', '-')}", role="colocated", replicas=2)
        observe(pool, endpoint=fake_http.url)
        plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name=strategy, strategy=strategy,
                                            steps=steps, router=router_for(fake_http.url), scale_down_delay_s=0, gates=[])
        services.rollout_start(plan=plan)
        for i in range(60):
            plan.refresh_from_db()
            if plan.state == "promoted":
                break
            if i % 2:
                observe(pool, endpoint=fake_http.url)
                fake_http.router_version = table_version()
            seen.append(_tick(plan))
        assert plan.state == "promoted", seen
    waiting = {outcome for outcome, message in seen if message.startswith("Waiting for")}
    assert waiting == {"waiting"}
    assert all(message.startswith("Waiting for") for outcome, message in seen if outcome == "waiting")
    assert {outcome for outcome, _ in seen} >= {"waiting", "set_weight", "analysis", "promoted", "switched"}


def test_steps_count_from_one_in_messages_logs_and_errors(make_pool, v2, operator_api):
    pool = make_pool("decode", role="colocated", replicas=1)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="c", strategy="canary",
                                        steps=[{"set_weight": 50}, {"pause": {}}, {"set_weight": 100}])
    services.rollout_start(plan=plan)
    for _ in range(4):
        observe(pool)
        _tick(plan)
    assert (plan.state, plan.current_step_index) == ("paused", 2)
    assert plan.message == "Paused at step 2 of 3 (pause until resumed) until resumed or promoted."
    plan = services.rollout_resume(plan=plan)
    assert plan.message == "Resumed by system at step 2 of 3 (pause until resumed)."
    observe(pool)
    assert _tick(plan)[0] == "set_weight"
    plan = services.rollout_pause(plan=plan)
    assert plan.message == "Paused by system at step 3 of 3 (set weight 100%)."
    r = operator_api.get(f"/api/v1/rollouts/{plan.pk}/")
    assert (r.json()["current_step_index"], r.json()["message"]) == (3, plan.message)
    plan = services.rollout_abort(plan=plan)
    assert plan.message == "Aborted by system at step 3 of 3 (set weight 100%)."
    steps = Action.objects.filter(kind="rollout.step", target_id=str(plan.pk)).order_by("id")
    assert [(a.params["step_index"], a.log[1]["message"]) for a in steps] == [
        (0, "step 1 of 3 (set weight 50%)"), (1, "step 2 of 3 (pause until resumed)"),
        (2, "step 3 of 3 (set weight 100%)")]
    r = operator_api.post("/api/v1/rollouts/", {
        "name": "bad", "pools": [pool.pk], "target_model_version": v2.pk, "strategy": "canary",
        "steps": [{"set_weight": 10}, {"pause": {"seconds": 0}}]}, format="json")
    assert r.json() == {"steps": ["Step 2: pause seconds must be an integer in 1..604800."]}
