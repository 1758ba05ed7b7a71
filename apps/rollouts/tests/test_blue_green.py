"""Blue-green: the switch waits for a full-size ready preview and a real completion through it; an abort
within the scale-down delay switches back to the old track without restarting it; after the delay the
old track goes away and the pool runs the new version; a failed backend switch is requested again."""

from datetime import timedelta

import pytest

from apps.fleet.models import Pool, Replica
from apps.operations.models import Action
from apps.orchestrators.base import BackendUnavailable, InvalidSpec
from apps.orchestrators.local_backend import LocalAgentBackend
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.tests.conftest import due_now, observe, table_weights

pytestmark = pytest.mark.django_db


@pytest.fixture
def started(make_pool, v2, settings):
    settings.FERRY_AGENT_TOKEN = "agent-token"  # the local backend answers switch_active without a request
    pool = make_pool("chat", role="colocated", replicas=2)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="bg", strategy="blue_green",
                                        steps=[], scale_down_delay_s=30)
    services.rollout_start(plan=plan)
    return pool, plan


def _tracks(pool):
    return {t.name: (t.model_version.version, t.replicas, t.active, t.weight) for t in pool.tracks.all()}


def _switch(pool, plan, fake_http):
    assert rollout_tick(rollout_id=plan.pk) == "waiting"
    plan.refresh_from_db()
    assert plan.message == "Waiting for dc-a/chat preview green: 0 of 2 replicas ready."
    assert fake_http.completions == 0
    observe(pool, endpoint=fake_http.url)
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "switched"
    assert fake_http.completions == 1
    assert fake_http.authorizations == [f"Bearer {pool.worker_token}"] * 2  # /v1/models, /v1/completions
    smoke = Action.objects.filter(kind="rollout.step", target_id=str(plan.pk), params={"phase": "smoke"}).get()
    assert smoke.log[1]["message"] == f"smoke test at {fake_http.url}: 4 tokens ' Paris'"
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "scale-down-delay"


def test_switch_waits_for_readiness_and_smoke_test(started, fake_http):
    pool, plan = started
    assert _tracks(pool) == {"green": ("v2", 2, False, 0), "stable": ("v1", 2, True, 100)}
    assert table_weights() == {"green": ("v2", 0), "stable": ("v1", 100)}
    _switch(pool, plan, fake_http)
    assert _tracks(pool) == {"green": ("v2", 2, True, 100), "stable": ("v1", 2, False, 0)}
    assert table_weights() == {"green": ("v2", 100), "stable": ("v1", 0)}
    plan.refresh_from_db()
    assert plan.progress["switched_services"] == {str(pool.pk): "green"}
    assert Action.objects.filter(target_type="rollout", target_id=str(plan.pk)).order_by("id").last().log[-1]["message"] == (
        "dc-a/chat: switch_active(green) -> routing_table")


def test_switch_back_within_the_delay_restores_blue_without_restarting_it(started, fake_http):
    pool, plan = started
    _switch(pool, plan, fake_http)
    before = {r.name: r.first_seen for r in Replica.objects.filter(pool=pool, track="stable")}
    plan = services.rollout_abort(plan=plan)
    assert plan.state == "aborted"
    assert table_weights() == {"green": ("v2", 0), "stable": ("v1", 100)}  # at once
    assert _tracks(pool) == {"green": ("v2", 0, False, 0), "stable": ("v1", 2, True, 100)}
    observe(pool, endpoint=fake_http.url)
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "reverted"
    assert _tracks(pool) == {"stable": ("v1", 2, True, 100)}
    assert {r.name: r.first_seen for r in Replica.objects.filter(pool=pool, track="stable")} == before


def test_after_the_delay_the_old_track_goes_and_the_pool_runs_the_new_version(started, fake_http):
    pool, plan = started
    _switch(pool, plan, fake_http)
    plan.refresh_from_db()
    assert rollout_tick(rollout_id=plan.pk, now=plan.next_step_at - timedelta(seconds=1)) == "not-due"
    assert rollout_tick(rollout_id=plan.pk, now=plan.next_step_at) == "promoted"
    assert _tracks(pool) == {"green": ("v2", 2, True, 100)}
    assert Pool.objects.get(pk=pool.pk).model_version.version == "v2"
    assert table_weights() == {"green": ("v2", 100)}


def test_failed_smoke_test_fails_the_rollout_and_removes_the_preview(started, fake_http):
    pool, plan = started
    fake_http.fail_completions = True
    observe(pool, endpoint=fake_http.url)
    assert rollout_tick(rollout_id=plan.pk) == "failed"
    plan.refresh_from_db()
    assert plan.message.startswith(f"smoke test at {fake_http.url}: HTTP 500: ")
    assert table_weights() == {"green": ("v2", 0), "stable": ("v1", 100)}
    observe(pool, endpoint=fake_http.url)
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "reverted"
    assert _tracks(pool) == {"stable": ("v1", 2, True, 100)}


def test_a_failed_switch_is_requested_again_on_the_next_tick(started, fake_http, monkeypatch):
    pool, plan = started
    errors = [InvalidSpec("service selector refused"), BackendUnavailable("agent down")]
    switch = LocalAgentBackend.switch_active

    def flaky(self, ref, track):  # noqa: ANN001
        if errors:
            raise errors.pop(0)
        return switch(self, ref, track)

    monkeypatch.setattr(LocalAgentBackend, "switch_active", flaky)
    observe(pool, endpoint=fake_http.url)
    assert rollout_tick(rollout_id=plan.pk) == "switched"
    first = Action.objects.get(kind="pool.switch_active", params__requester=f"rollout:{plan.pk}")
    assert (first.status, first.error) == ("failed", "InvalidSpec: service selector refused")
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"
    plan.refresh_from_db()
    second = Action.objects.filter(kind="pool.switch_active").exclude(pk=first.pk).get()
    assert plan.message == (f"Waiting for dc-a/chat: switch_active(green) (action #{second.pk}) (action #{first.pk} "
                            "failed: InvalidSpec: service selector refused).")
    assert (second.status, second.attempts) == ("pending", 1)  # BackendUnavailable: released for a retry
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"
    plan.refresh_from_db()
    assert plan.message == f"Waiting for dc-a/chat: switch_active(green) (action #{second.pk} pending)."
    assert Action.objects.get(pk=second.pk).status == "succeeded"  # run again after that tick
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "scale-down-delay"
    plan.refresh_from_db()
    assert plan.progress["switched_services"] == {str(pool.pk): "green"}
    assert Action.objects.filter(kind="pool.switch_active").count() == 2


def test_the_old_track_stays_after_the_delay_until_a_new_replica_that_died_is_ready_again(started, fake_http):
    """Chaos matrix, blue-green x model:new: the new track's replica was killed after the switch and the old track
    was removed at the end of the delay anyway, leaving no ready replica (503 until the restart)."""
    pool, plan = started
    _switch(pool, plan, fake_http)
    Replica.objects.filter(pool=pool, name="chat-green-1").update(ready=False)  # died, restarting
    plan.refresh_from_db()
    assert rollout_tick(rollout_id=plan.pk, now=plan.next_step_at) == "waiting"
    plan.refresh_from_db()
    assert plan.message == "Waiting for dc-a/chat green: 1 of 2 replicas ready before the old track goes."
    assert _tracks(pool) == {"green": ("v2", 2, True, 100), "stable": ("v1", 2, False, 0)}
    observe(pool, endpoint=fake_http.url)  # restarted and ready
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "promoted"
    assert _tracks(pool) == {"green": ("v2", 2, True, 100)}
