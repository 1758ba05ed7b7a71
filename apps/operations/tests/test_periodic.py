"""Beat setup (django-celery-beat rows), task routing, and the autoscaler's evaluation over the database."""

from datetime import UTC, datetime

import pytest
from django.core.management import call_command
from django_celery_beat.models import PeriodicTask

from apps.operations.autoscale import autoscale_all, pool_autoscale
from apps.operations.models import Action, AutoscalerState
from apps.operations.services import action_cancel

pytestmark = pytest.mark.django_db


def test_beat_setup_creates_the_periodic_tasks_once_and_keeps_an_admin_disable(settings):
    settings.FERRY_RECONCILE_INTERVAL_S = 5
    call_command("ferry_beat_setup", stdout=open("/dev/null", "w"))
    reconcile = PeriodicTask.objects.get(name="ferry: reconcile")
    assert (reconcile.task, reconcile.queue, reconcile.interval.every, reconcile.interval.period) == (
        "operations.reconcile", "reconcile", 5, "seconds")
    reconcile.enabled = False
    reconcile.save()
    call_command("ferry_beat_setup", stdout=open("/dev/null", "w"))
    assert PeriodicTask.objects.filter(name__startswith="ferry: ").count() == 2
    assert PeriodicTask.objects.get(name="ferry: reconcile").enabled is False
    assert PeriodicTask.objects.get(name="ferry: autoscale").task == "operations.autoscale"


def test_tasks_have_explicit_names_and_queues():
    from controlplane.celery import app

    app.loader.import_default_modules()
    route = app.amqp.router.route
    assert route({}, "operations.execute_action")["queue"].name == "operations"
    assert route({}, "operations.reconcile")["queue"].name == "reconcile"
    assert route({}, "operations.autoscale")["queue"].name == "reconcile"
    execute = app.tasks["operations.execute_action"]
    assert (execute.acks_late, execute.max_retries, execute.soft_time_limit, execute.time_limit) == (True, 5, 900, 960)
    assert app.tasks["operations.reconcile"].acks_late is False


def test_autoscaler_requests_a_scale_action_with_its_reason_and_respects_the_lock(make_pool):
    pool = make_pool(name="decode-b", replicas=2, autoscaling_enabled=True, min_replicas=1, max_replicas=8,
                     autoscaling_target=4.0, scale_down_stabilization_s=0)
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    decision, action = pool_autoscale(pool, now=now, value=20.0, ready_replicas=2, read_signals=False)
    assert (decision.replicas, action.kind, action.params["replicas"]) == (5, "pool.scale", 5)
    assert action.params["reason"] == "num_requests_waiting=20 total / target 4 per replica -> 5"
    assert action.idempotency_key == f"autoscaler:pool-{pool.pk}:5:after-0"
    state = AutoscalerState.objects.get(pool=pool)
    assert (state.last_replicas, state.last_value, state.recommendations) == (5, 20.0, [[now.timestamp(), 5]])
    # While that Action is pending the pool is locked: the periodic evaluation skips it.
    assert autoscale_all()["busy"] == 1 and Action.objects.count() == 1
    action_cancel(action=action)
    held, none = pool_autoscale(pool, now=now, value=None, ready_replicas=None, read_signals=False)
    assert (held.replicas, none) == (None, None)
    assert held.reason == "no data for num_requests_waiting: holding at 2"


def test_schedule_window_on_a_pool_without_autoscaling_scales_it(make_pool):
    pool = make_pool(name="prefill-b", role="prefill", replicas=3, schedule_time_zone="Asia/Tokyo",
                     schedule_overrides=[{"start": "22:00", "end": "06:00", "replicas": 1}])
    night = datetime(2026, 11, 30, 14, 0, tzinfo=UTC)  # 23:00 in Tokyo (UTC+9)
    decision, action = pool_autoscale(pool, now=night, read_signals=False)
    assert action.params == {"replicas": 1, "reason": "schedule window 22:00-06:00 Asia/Tokyo (local Mon 23:00) "
                                                      "sets 1"}
    assert AutoscalerState.objects.get(pool=pool).base_replicas == 3
