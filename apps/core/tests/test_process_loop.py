"""Long-running loops start each iteration as Django starts a request (``apps.core.process_loop``): with
``DEBUG`` on, the query log holds one iteration's queries, never all of them (the soak's slow growth of the
telemetry poller and the reconcile ticks). The poller's own loop is checked in ``apps/telemetry``."""

from __future__ import annotations

import pytest
from celery.signals import task_prerun
from celery.utils.imports import symbol_by_name
from django.conf import settings as django_settings
from django.contrib.auth.models import Group
from django.db import connection
from django_celery_beat.schedulers import DatabaseScheduler

from apps.core.process_loop import loop_iteration_started
from controlplane.beat import Scheduler
from controlplane.celery import app

COUNT_GROUPS_SQL = 'SELECT COUNT(*) AS "__count" FROM "auth_group"'


@app.task(name="tests.core.count_groups")
def count_groups() -> int:
    return Group.objects.count()


def logged_sql() -> list[str]:
    return [query["sql"] for query in connection.queries_log]


@pytest.mark.django_db(transaction=True)
def test_a_loop_iteration_keeps_only_its_own_queries_in_the_debug_log(settings):
    settings.DEBUG = True
    for _ in range(20):
        loop_iteration_started()
        Group.objects.count()
    assert logged_sql() == [COUNT_GROUPS_SQL]


@pytest.mark.django_db(transaction=True)
def test_each_task_a_celery_worker_runs_starts_with_an_empty_query_log(settings):
    settings.DEBUG = True
    for n in range(20):
        # what the worker's tracer sends before each task (celery.app.trace), then the task body
        task_prerun.send(sender=count_groups, task_id=f"t{n}", task=count_groups, args=(), kwargs={})
        count_groups()
    assert logged_sql() == [COUNT_GROUPS_SQL]


@pytest.mark.django_db(transaction=True)
def test_an_eager_task_keeps_its_callers_query_log(settings):
    settings.DEBUG = True
    groups = Group.objects.count()
    assert count_groups.apply().get() == groups
    assert logged_sql() == [COUNT_GROUPS_SQL, COUNT_GROUPS_SQL]


@pytest.mark.django_db(transaction=True)
def test_every_beat_tick_starts_with_an_empty_query_log(settings, monkeypatch):
    settings.DEBUG = True
    monkeypatch.setattr(DatabaseScheduler, "tick", lambda self, *args, **kwargs: 5.0 + 0 * Group.objects.count())
    scheduler = Scheduler.__new__(Scheduler)  # the tick alone: no schedule is loaded, nothing is sent
    assert [scheduler.tick() for _ in range(20)] == [5.0] * 20
    assert logged_sql() == [COUNT_GROUPS_SQL]
    assert symbol_by_name(django_settings.CELERY_BEAT_SCHEDULER) is Scheduler
