"""One road for desired state (issue 15, acceptance 3): every PoolTrack change the rollout controller makes is one
``pool.*`` Action requested by ``rollout:<id>``, and no backend call happens while a rollout or pool row lock is
held (nor inside the transaction that wrote the tracks). The same holds for the operator's scale (requester: the
user's name), the autoscaler's (``autoscaler``) and an operator's change of a pool's model version, and PoolTrack
rows are written only by ``apps/operations/tracks.py`` (checked with ``ast``).

The check is made at every backend call by a recording fake backend: ``connection.in_atomic_block`` of the
calling thread, plus a probe from a second database connection that tries ``SELECT ... FOR UPDATE NOWAIT`` on
the plan row, the pools' rows and their track rows (PostgreSQL answers "lock not available" while another
transaction holds or has written one of them). Actions run as the Celery worker runs them (the task, eagerly,
when the transaction that enqueued them commits); PoolTrack changes are counted from Django's model signals.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from celery import current_app as celery_app
from django.db import OperationalError, connection, transaction
from django.db.models.signals import post_delete, post_save

from apps.fleet.models import Pool, PoolTrack
from apps.operations import backends
from apps.operations.models import Action
from apps.orchestrators.base import ROUTING_TABLE, ObservedState, ObservedTrack, OrchestratorBackend
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.models import RolloutPlan
from apps.rollouts.tests.conftest import due_now, observe

pytestmark = pytest.mark.django_db(transaction=True)


def locks_held(plan_id: int, pool_ids: list[int]) -> list[str]:
    """Rows another connection cannot lock right now (``FOR UPDATE NOWAIT`` from a second connection)."""
    held: list[str] = []
    queries = [("rollout", "SELECT id FROM rollouts_rolloutplan WHERE id = %s FOR UPDATE NOWAIT", [plan_id]),
               ("pool", "SELECT id FROM fleet_pool WHERE id = ANY(%s) FOR UPDATE NOWAIT", [pool_ids]),
               ("pool track", "SELECT id FROM fleet_pooltrack WHERE pool_id = ANY(%s) FOR UPDATE NOWAIT", [pool_ids])]

    def probe() -> None:
        try:
            for what, sql, args in queries:
                try:
                    with transaction.atomic(), connection.cursor() as cursor:
                        cursor.execute(sql, args)
                except OperationalError:  # 55P03 lock_not_available
                    held.append(what)
        finally:
            connection.close()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return held


class RecordingBackend(OrchestratorBackend):
    """A backend that records each call with what was locked at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.under_lock: list[tuple[str, str, bool, list[str]]] = []
        self.plan_id, self.pool_ids = 0, []

    def _call(self, verb: str, track: str) -> None:
        self.calls.append((verb, track))
        held = locks_held(self.plan_id, self.pool_ids)
        if connection.in_atomic_block or held:
            self.under_lock.append((verb, track, connection.in_atomic_block, held))

    def apply_pool_track(self, spec) -> None:  # noqa: ANN001
        self._call("apply_pool_track", spec.track)

    def scale_track(self, pool, track: str, replicas: int) -> None:  # noqa: ANN001
        self._call("scale_track", track)

    def set_traffic_weights(self, pool, weights) -> str:  # noqa: ANN001
        self._call("set_traffic_weights", ",".join(sorted(weights)))
        return ROUTING_TABLE

    def switch_active(self, pool, active_track: str) -> str:  # noqa: ANN001
        self._call("switch_active", active_track)
        return ROUTING_TABLE

    def delete_track(self, pool, track: str) -> None:  # noqa: ANN001
        self._call("delete_track", track)

    def restart_replica(self, pool, replica: str) -> None:  # noqa: ANN001
        self._call("restart_replica", replica)

    def observe(self, pool) -> ObservedState:  # noqa: ANN001
        return ObservedState(pool_name=pool.pool_name)

    def logs(self, pool, replica: str, tail: int = 100) -> str:  # noqa: ANN001
        return ""

    def close(self) -> None:
        pass


class ConvergedBackend(RecordingBackend):
    """A recording backend whose ``observe`` reports every desired track ready (so ``pool.scale`` stops waiting)."""

    def observe(self, pool) -> ObservedState:  # noqa: ANN001
        rows = PoolTrack.objects.filter(pool_id=pool.pool_id)
        return ObservedState(pool_name=pool.pool_name, tracks={
            t.name: ObservedTrack(track=t.name, desired_replicas=t.replicas, ready_replicas=t.replicas) for t in rows})


def _install(monkeypatch, fake: RecordingBackend):  # noqa: ANN001
    monkeypatch.setattr(backends, "backend_for_cluster", lambda cluster: fake)
    # Register every app's tasks (Celery autodiscovery) so an Action sent by its task name runs eagerly even when
    # this module runs alone (else the name is unknown and the message goes to the broker).
    celery_app.loader.import_default_modules()
    eager = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True  # Actions run as the worker runs them, when their transaction commits
    yield fake
    celery_app.conf.task_always_eager = eager


@pytest.fixture
def backend(monkeypatch):
    yield from _install(monkeypatch, RecordingBackend())


@pytest.fixture
def converged_backend(monkeypatch):
    yield from _install(monkeypatch, ConvergedBackend())


@pytest.fixture
def track_changes():
    """Every PoolTrack row written or deleted, in order: ``("set"|"delete", track name)``."""
    changes: list[tuple[str, str]] = []

    def saved(sender, instance, **kwargs) -> None:  # noqa: ANN001
        changes.append(("set", instance.name))

    def deleted(sender, instance, **kwargs) -> None:  # noqa: ANN001
        changes.append(("delete", instance.name))

    post_save.connect(saved, sender=PoolTrack, dispatch_uid="test-track-changes-save")
    post_delete.connect(deleted, sender=PoolTrack, dispatch_uid="test-track-changes-delete")
    yield changes
    post_save.disconnect(dispatch_uid="test-track-changes-save", sender=PoolTrack)
    post_delete.disconnect(dispatch_uid="test-track-changes-delete", sender=PoolTrack)


def _tick_until(plan: RolloutPlan, done, *, endpoint: str = "", max_ticks: int = 40) -> None:  # noqa: ANN001
    for _ in range(max_ticks):
        plan.refresh_from_db()
        if done(plan):
            return
        for pool in plan.pools.all():
            observe(pool, endpoint=endpoint)
        rollout_tick(rollout_id=plan.pk, now=due_now(plan) + timedelta(milliseconds=1))
    raise AssertionError(f"{plan.name}: {plan.state}/{plan.phase}: {plan.message}")


def _track_actions(plan: RolloutPlan) -> list[Action]:
    return list(Action.objects.filter(params__requester=f"rollout:{plan.pk}").order_by("id"))


def _assert_one_action_per_change(plan: RolloutPlan, changes: list[tuple[str, str]]) -> list[Action]:
    actions = _track_actions(plan)
    writes = [a for a in actions if a.kind in ("pool.track_set", "pool.track_delete")]
    assert [("delete" if a.kind == "pool.track_delete" else "set", a.params["track"]) for a in writes] == changes
    assert all(a.target_type == "pool" and a.log[0]["message"] == f"requested by rollout:{plan.pk}"
               for a in actions)
    assert {a.status for a in actions} == {"succeeded"}
    return actions


def test_probe_sees_a_held_rollout_lock(make_pool, v2):
    pool = make_pool("chat", role="colocated", replicas=1)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="c", strategy="canary",
                                        steps=[{"set_weight": 50}])
    assert locks_held(plan.pk, [pool.pk]) == []
    with transaction.atomic():
        RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        assert locks_held(plan.pk, [pool.pk]) == ["rollout"]
        Pool.objects.select_for_update().get(pk=pool.pk)
        PoolTrack.objects.filter(pool=pool).update(weight=100)
        assert locks_held(plan.pk, [pool.pk]) == ["rollout", "pool", "pool track"]
    assert locks_held(plan.pk, [pool.pk]) == []


def test_canary_track_changes_are_actions_and_backend_calls_wait_for_the_commit(make_pool, v2, backend,
                                                                                track_changes):
    pools = [make_pool("prefill", role="prefill", replicas=1), make_pool("decode", role="decode", replicas=2)]
    for pool in pools:
        observe(pool)
    plan = services.rollout_plan_create(pools=pools, target_model_version=v2, name="c", strategy="canary",
                                        steps=[{"set_weight": 50}])
    backend.plan_id, backend.pool_ids = plan.pk, [p.pk for p in pools]
    track_changes.clear()  # the pools' own creation
    services.rollout_start(plan=plan)
    _tick_until(plan, lambda p: p.state == "promoted")
    actions = _assert_one_action_per_change(plan, track_changes)
    assert len(actions) == len(track_changes) == 34  # 2 pools: create, grow, weights, finalize, shrink, delete
    executed = [a for a in actions if a.attempts == 1]
    assert len(actions) - len(executed) == 16  # weight changes: routing table only, recorded as done
    assert backend.under_lock == []
    # every executed Action made one backend call but the last canary shrink, which ran after its track was
    # deleted in the same tick (the delete Action removed it)
    assert len(backend.calls) == len(executed) - 1 == 17
    assert [m["message"] for a in executed for m in a.log].count("track canary is no longer desired: nothing to do") == 1
    assert backend.calls.count(("delete_track", "canary")) == 2


def test_blue_green_switch_and_switch_back_are_actions_run_after_the_commit(make_pool, v2, backend, track_changes,
                                                                             fake_http):
    pool = make_pool("chat", role="colocated", replicas=2)
    observe(pool, endpoint=fake_http.url)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="bg", strategy="blue_green",
                                        steps=[], scale_down_delay_s=3600)
    backend.plan_id, backend.pool_ids = plan.pk, [pool.pk]
    track_changes.clear()  # the pool's own creation
    services.rollout_start(plan=plan)
    _tick_until(plan, lambda p: "switched_at" in p.progress, endpoint=fake_http.url)
    services.rollout_abort(plan=plan)
    _tick_until(plan, lambda p: not p.progress["cleanup"], endpoint=fake_http.url)
    actions = _assert_one_action_per_change(plan, track_changes)
    switches = [a.params["track"] for a in actions if a.kind == "pool.switch_active"]
    assert switches == ["green", "stable"]
    assert [c for c in backend.calls if c[0] == "switch_active"] == [("switch_active", "green"),
                                                                    ("switch_active", "stable")]
    assert backend.under_lock == []
    assert PoolTrack.objects.filter(pool=pool).count() == 1


def _pool_track_actions(pool: Pool) -> list[Action]:
    return list(Action.objects.filter(target_type="pool", target_id=str(pool.pk), kind__startswith="pool.track_")
                .order_by("id"))


def _assert_requested_by(actions: list[Action], changes: list[tuple[str, str]], requester: str) -> None:
    assert [("set", a.params["track"]) for a in actions] == changes
    assert [(a.params["requester"], a.log[0]["message"], a.status) for a in actions] == [
        (requester, f"requested by {requester}", "succeeded")] * len(changes)


def test_operator_scale_during_a_rollout_resplits_with_one_action_per_track_by_the_user(
        make_pool, v2, converged_backend, track_changes, operator_api):
    pool = make_pool("chat", role="colocated", replicas=2)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="c", strategy="canary",
                                        steps=[{"set_weight": 50}, {"pause": {}}])
    converged_backend.plan_id, converged_backend.pool_ids = plan.pk, [pool.pk]
    services.rollout_start(plan=plan)
    _tick_until(plan, lambda p: p.state == "paused")  # at the pause step: 50% canary
    assert dict(PoolTrack.objects.filter(pool=pool).values_list("name", "replicas")) == {"stable": 1, "canary": 1}
    before = Action.objects.count()
    track_changes.clear()
    converged_backend.calls.clear()
    response = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 4}, format="json")
    assert response.status_code == 201, response.json()
    scale = Action.objects.get(pk=response.json()["id"])
    assert (scale.status, scale.requested_by.username, scale.pool_id) == ("succeeded", "otto", pool.pk)
    assert dict(PoolTrack.objects.filter(pool=pool).values_list("name", "replicas")) == {"stable": 2, "canary": 2}
    actions = _pool_track_actions(pool)[-2:]
    _assert_requested_by(actions, track_changes, "otto")
    assert track_changes == [("set", "canary"), ("set", "stable")]
    assert {a.requested_by.username for a in actions} == {"otto"}
    assert [a.params["changes"] for a in actions] == [{"replicas": 2}, {"replicas": 2}]
    assert Action.objects.count() - before == 3  # the pool.scale and one pool.track_set per changed track
    assert converged_backend.calls == [("apply_pool_track", "canary"), ("apply_pool_track", "stable")]
    assert converged_backend.under_lock == []
    # The operator's one action at a time per pool still holds while the scale runs (its pool lock).
    running = Action.objects.create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), pool=pool,
                                    status="running")
    refused = operator_api.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": 6}, format="json")
    assert (refused.status_code, refused.json()["detail"]) == (409, (
        f"Pool dc-a/chat already has action #{running.pk} (pool.scale, running); "
        "wait for it to finish or cancel it, then retry."))


def test_autoscaler_scale_is_one_track_action_requested_by_autoscaler(make_pool, converged_backend, track_changes):
    from datetime import UTC, datetime

    from apps.operations.autoscale import pool_autoscale

    pool = make_pool("decode-b", replicas=2, autoscaling_enabled=True, min_replicas=1, max_replicas=8,
                     autoscaling_target=4.0, scale_down_stabilization_s=0)
    converged_backend.pool_ids = [pool.pk]
    track_changes.clear()  # the pool's own creation
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    _, scale = pool_autoscale(pool, now=now, value=20.0, ready_replicas=2, read_signals=False)
    scale.refresh_from_db()
    assert (scale.status, scale.requested_by, scale.log[0]["message"]) == ("succeeded", None,
                                                                         "requested by autoscaler")
    assert track_changes == [("set", "stable")]
    _assert_requested_by(_pool_track_actions(pool), track_changes, "autoscaler")
    assert PoolTrack.objects.get(pool=pool).replicas == 5
    assert converged_backend.calls == [("apply_pool_track", "stable")]
    assert converged_backend.under_lock == []
    # A duplicate delivery of the scale (a redelivered message) does nothing, and re-running its handler (a
    # takeover) records no second track Action: the row already holds the split.
    from apps.operations import handlers
    from apps.operations.tasks import execute_action

    assert execute_action.apply(args=[scale.pk]).get() == "skipped"
    handlers.HANDLERS["pool.scale"](scale)
    assert len(_pool_track_actions(pool)) == 1 and track_changes == [("set", "stable")]
    assert converged_backend.calls == [("apply_pool_track", "stable")]  # its track Action already ran: no second call


def test_model_version_update_is_one_track_action_by_the_user_applied_after_the_commit(
        make_pool, make_model_version, converged_backend, track_changes, admin_api):
    pool = make_pool("decode-c", replicas=2)
    v9 = make_model_version("v9")
    converged_backend.pool_ids = [pool.pk]
    track_changes.clear()
    response = admin_api.patch(f"/api/v1/pools/{pool.pk}/", {"model_version": v9.pk}, format="json")
    assert response.status_code == 200, response.json()
    assert track_changes == [("set", "stable")]
    actions = _pool_track_actions(pool)
    _assert_requested_by(actions, track_changes, "ada")
    assert actions[0].params["changes"] == {"model_version": "v9"}
    assert converged_backend.calls == [("apply_pool_track", "stable")]
    assert converged_backend.under_lock == []
    assert admin_api.patch(f"/api/v1/pools/{pool.pk}/", {"drain_timeout_s": 9}, format="json").status_code == 200
    assert len(_pool_track_actions(pool)) == 1  # a settings change touches no track
