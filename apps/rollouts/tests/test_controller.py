"""Controller: duplicate step deliveries, PD coordination and pairing, router acknowledgement, the beat tick."""

import threading

import pytest
from django.db import connection

from apps.fleet.models import Replica
from apps.fleet.selectors import routing_table_current
from apps.fleet.testing import router_for
from apps.operations.models import Action
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.models import RolloutPlan
from apps.rollouts.tasks import rollout_advance, rollouts_due, rollouts_tick
from apps.rollouts.tests.conftest import drive, due_now, observe, table_version, table_weights


def _colocated_plan(make_pool, v2, steps, replicas=3, **fields):
    pool = make_pool("decode", role="colocated", replicas=replicas)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="dup", strategy="canary",
                                        steps=steps, **fields)
    services.rollout_start(plan=plan)
    return pool, plan


def _ready_canary_first(pool):
    """A backend that is quick: the first canary replica is already up when the step applies it."""
    Replica.objects.create(pool=pool, name=f"{pool.name}-canary-0", track="canary", endpoint="http://127.0.0.1:1/c",
                           ready=True, alive=True, version="v2", last_seen=pool.created_at)


@pytest.mark.django_db
def test_duplicate_delivery_of_a_step_task_applies_it_once(make_pool, v2):
    pool, plan = _colocated_plan(make_pool, v2, [{"set_weight": 33}, {"set_weight": 66}])
    _ready_canary_first(pool)
    version = table_version()
    assert rollout_advance.apply(args=[plan.pk, 0]).get() == "set_weight"
    assert rollout_advance.apply(args=[plan.pk, 0]).get() == "skipped"  # redelivered message
    plan.refresh_from_db()
    assert plan.current_step_index == 1
    assert Action.objects.filter(kind="rollout.step", target_id=str(plan.pk)).count() == 1
    assert table_version() == version + 1
    assert table_weights() == {"canary": ("v2", 33), "stable": ("v1", 67)}


@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicate_deliveries_apply_the_step_once(make_pool, v2):
    pool, plan = _colocated_plan(make_pool, v2, [{"set_weight": 33}, {"set_weight": 66}])
    _ready_canary_first(pool)
    version = table_version()
    barrier, outcomes = threading.Barrier(2), []

    def deliver():
        try:
            barrier.wait()
            outcomes.append(rollout_tick(rollout_id=plan.pk, step_index=0))
        finally:
            connection.close()

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["set_weight", "skipped"]
    assert RolloutPlan.objects.get(pk=plan.pk).current_step_index == 1
    assert Action.objects.filter(kind="rollout.step", target_id=str(plan.pk)).count() == 1
    assert table_version() == version + 1


@pytest.mark.django_db
def test_r1_w10_surges_one_canary_and_keeps_the_stable_replica(make_pool, v2):
    pool, plan = _colocated_plan(make_pool, v2, [{"set_weight": 10}, {"pause": {}}], replicas=1)
    drive(plan, until=("paused",))
    assert {t.name: (t.replicas, t.weight) for t in pool.tracks.all()} == {"stable": (1, 90), "canary": (1, 10)}


@pytest.mark.django_db
def test_r1_w10_without_surge_is_refused_at_start(make_pool, v2):
    pool = make_pool("decode", role="colocated", replicas=1)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="tiny", strategy="canary",
                                        steps=[{"set_weight": 10}], max_surge=0)
    with pytest.raises(Exception) as exc:
        services.rollout_start(plan=plan)
    assert str(exc.value).startswith("Step 1 of 1 on pool dc-a/decode: weight 10% on 1 replica(s) needs 1 canary")
    assert RolloutPlan.objects.get(pk=plan.pk).state == "pending"


@pytest.fixture
def pd(make_pool, v2):
    prefill, decode = make_pool("prefill", role="prefill", replicas=2), make_pool("decode", role="decode", replicas=2)
    observe(prefill)
    observe(decode)
    return prefill, decode


def _pd_plan(pd, v2, skew):
    plan = services.rollout_plan_create(pools=list(pd), target_model_version=v2, name="pd", strategy="canary",
                                        steps=[{"set_weight": 50}, {"pause": {}}], max_weight_skew=skew)
    services.rollout_start(plan=plan)
    return plan


@pytest.mark.django_db
@pytest.mark.parametrize(("skew", "weight_before_prefill"), [(0, 0), (20, 20)])
def test_pd_weight_waits_for_the_prefill_canary_within_skew(pd, v2, skew, weight_before_prefill):
    prefill, decode = pd
    plan = _pd_plan(pd, v2, skew)
    assert rollout_tick(rollout_id=plan.pk) == "set_weight"
    observe(decode)  # decode canary ready, prefill canary not yet
    rollout_tick(rollout_id=plan.pk)
    assert table_weights()["canary"] == ("v2", weight_before_prefill)
    observe(prefill)
    drive(plan, until=("paused",))
    assert table_weights() == {"canary": ("v2", 50), "stable": ("v1", 50)}
    # pairing: every replica is listed with its model version; the router sends v2 KV only to v2 decode
    pools = {p["name"]: p for p in routing_table_current().content["pools"]}
    for name in ("prefill", "decode"):
        assert {(r["track"], r["model_version"]) for r in pools[name]["replicas"]} == {("canary", "v2"),
                                                                                      ("stable", "v1")}


@pytest.mark.django_db
def test_step_waits_until_the_router_reports_the_new_table_version(make_pool, v2, fake_http):
    pool, plan = _colocated_plan(make_pool, v2, [{"set_weight": 33}, {"pause": {}}], router=router_for(fake_http.url))
    fake_http.router_version = table_version()  # the router applied the table of the start
    for _ in range(4):
        observe(pool)
        rollout_tick(rollout_id=plan.pk, now=due_now(plan))
    plan.refresh_from_db()
    assert (plan.state, plan.current_step_index) == ("progressing", 1)
    awaited = plan.progress["await_version"]
    assert awaited == table_version()
    assert table_weights()["canary"] == ("v2", 33)
    assert plan.message == f"Waiting for the router at {fake_http.url} to apply routing table v{awaited} (it reports {awaited - 1})."
    fake_http.router_version = awaited
    drive(plan, until=("paused",), max_ticks=3)


@pytest.mark.django_db
def test_beat_tick_advances_due_rollouts_only(make_pool, v2, settings):
    settings.FERRY_ROLLOUT_TICK_S = 0
    pool, plan = _colocated_plan(make_pool, v2, [{"set_weight": 33}, {"pause": {"seconds": 3600}}])
    assert rollouts_due() == [(plan.pk, 0)]
    assert rollouts_tick.apply().get() == {"set_weight": 1}
    observe(pool)
    assert rollouts_tick.apply().get() == {"paused-timed": 1}
    plan.refresh_from_db()
    assert plan.current_step_index == 2
    assert rollouts_due() == []
    assert rollouts_tick.apply().get() == {}


@pytest.mark.django_db
def test_status_counts_steps_from_1_and_says_all_done_only_after_the_last_step(make_pool, v2):
    """The last step in effect (a timed pause here) is named, 1-based; "All 2 steps done" only once it is over."""
    from datetime import timedelta

    from django.utils import timezone

    pool, plan = _colocated_plan(make_pool, v2, [{"set_weight": 50}, {"pause": {"seconds": 30}}])
    messages = []
    for _ in range(12):
        observe(pool)
        outcome = rollout_tick(rollout_id=plan.pk, now=due_now(plan) + timedelta(milliseconds=1))
        plan.refresh_from_db()
        messages.append((outcome, plan.current_step_index, plan.message))
        if outcome == "paused-timed":
            break
    assert messages[-1] == ("paused-timed", 2, "At step 2 of 2 (pause 30 s): canary weight 50%.")
    assert rollout_tick(rollout_id=plan.pk, now=timezone.now() + timedelta(seconds=10)) != "to-100"
    plan.refresh_from_db()
    assert plan.message == "At step 2 of 2 (pause 30 s): canary weight 50%."
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan) + timedelta(milliseconds=1)) == "to-100"
    plan.refresh_from_db()
    assert plan.message == "All 2 steps done: canary weight 66% (target 100%)."
