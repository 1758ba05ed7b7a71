"""Traffic leaves a track before its replicas do: with a router, a track whose weight drops keeps its replicas
until the router reports the routing table without that traffic — for a canary step that empties stable, an
abort, and a blue-green switch-back. Regression: weight and replicas changed in the same tick, so the backend
could stop a replica while the router still sent it requests by the previous table (client errors on a
draining worker with no same-version replica to retry on)."""

import pytest

from apps.fleet.models import PoolTrack
from apps.fleet.testing import router_for
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.tests.conftest import due_now, observe, table_version, table_weights

pytestmark = pytest.mark.django_db


def _tracks(pool):
    return {t.name: (t.replicas, t.weight) for t in PoolTrack.objects.filter(pool=pool)}


def _canary(make_pool, v2, fake_http, steps):
    pool = make_pool("chat", role="colocated", replicas=1)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="c", strategy="canary",
                                        steps=steps, router=router_for(fake_http.url))
    services.rollout_start(plan=plan)
    fake_http.router_version = table_version()
    return pool, plan


def test_step_to_100_keeps_stable_replicas_until_the_router_applied_the_table(make_pool, v2, fake_http):
    pool, plan = _canary(make_pool, v2, fake_http, [{"set_weight": 100}])
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "set_weight"
    assert _tracks(pool) == {"stable": (1, 100), "canary": (1, 0)}  # canary surges in, no traffic yet
    fake_http.router_version = table_version()
    observe(pool)  # the canary replica is ready
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"
    assert table_weights() == {"canary": ("v2", 100), "stable": ("v1", 0)}
    assert _tracks(pool) == {"stable": (1, 0), "canary": (1, 100)}  # weight moved, stable replica kept
    plan.refresh_from_db()
    assert plan.message == "Waiting for the router to apply the new weights before replicas are removed."
    observe(pool)
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"  # router still on the old table
    assert _tracks(pool)["stable"] == (1, 0)
    plan.refresh_from_db()
    assert plan.message == (f"Waiting for the router at {fake_http.url} to apply routing table v{table_version()} "
                            f"(it reports {table_version() - 1}).")
    fake_http.router_version = table_version()
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"
    assert _tracks(pool) == {"stable": (0, 0), "canary": (1, 100)}  # now it may go


def test_abort_moves_traffic_at_once_and_stops_the_canary_after_the_router_applied_it(make_pool, v2, fake_http):
    pool, plan = _canary(make_pool, v2, fake_http, [{"set_weight": 50}, {"pause": {}}])
    for _ in range(3):
        observe(pool)
        fake_http.router_version = table_version()
        rollout_tick(rollout_id=plan.pk, now=due_now(plan))
    plan.refresh_from_db()
    assert plan.state == "paused" and _tracks(pool) == {"stable": (1, 50), "canary": (1, 50)}
    plan = services.rollout_abort(plan=plan)
    assert table_weights() == {"canary": ("v2", 0), "stable": ("v1", 100)}  # traffic back at once
    assert _tracks(pool) == {"stable": (1, 100), "canary": (1, 0)}  # the canary replica still runs
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "reverting"
    assert _tracks(pool)["canary"] == (1, 0)
    fake_http.router_version = table_version()  # the router applied it: the canary may go
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "reverted"
    assert _tracks(pool) == {"stable": (1, 100)}


def test_blue_green_switch_back_stops_the_preview_after_the_router_applied_it(make_pool, v2, fake_http, settings):
    settings.FERRY_AGENT_TOKEN = "agent-token"  # the local backend answers switch_active without a request
    pool = make_pool("chat", role="colocated", replicas=1)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="bg", strategy="blue_green",
                                        steps=[], scale_down_delay_s=60, router=router_for(fake_http.url))
    services.rollout_start(plan=plan)
    observe(pool, endpoint=fake_http.url)
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "switched"
    fake_http.router_version = table_version()
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "scale-down-delay"
    plan = services.rollout_abort(plan=plan)
    assert table_weights() == {"green": ("v2", 0), "stable": ("v1", 100)}
    assert _tracks(pool) == {"green": (1, 0), "stable": (1, 100)}  # green keeps serving stragglers
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "reverting"
    assert _tracks(pool)["green"] == (1, 0)
    fake_http.router_version = table_version()  # the router applied it: the preview may go
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "reverted"
    assert _tracks(pool) == {"stable": (1, 100)}


def test_without_a_router_replicas_and_weights_move_together(make_pool, v2):
    pool = make_pool("chat", role="colocated", replicas=1)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="c", strategy="canary",
                                        steps=[{"set_weight": 50}, {"pause": {}}])
    services.rollout_start(plan=plan)
    for _ in range(3):
        observe(pool)
        rollout_tick(rollout_id=plan.pk, now=due_now(plan))
    plan = services.rollout_abort(plan=plan)
    assert _tracks(pool) == {"stable": (1, 100), "canary": (0, 0)}
