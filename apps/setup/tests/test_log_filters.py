"""The periodic ticks' per-task Celery lines are dropped; other tasks' lines and failures stay."""

from __future__ import annotations

import logging

import pytest
from celery.app.trace import LOG_FAILURE, LOG_RECEIVED, LOG_SUCCESS

from apps.core.log_filters import PERIODIC_TASK_NAMES, PeriodicTaskInfoFilter
from apps.operations.management.commands.ferry_beat_setup import PERIODIC_TASKS
from apps.setup.management.commands.ferry_setup import EXTRA_PERIODIC_TASKS


def test_the_filter_names_every_periodic_task_setup_creates():
    created = {task for task, _, _ in PERIODIC_TASKS.values()} | set(EXTRA_PERIODIC_TASKS)
    assert created == PERIODIC_TASK_NAMES


@pytest.fixture
def celery_loggers():
    """Celery's two per-task loggers with the filter the settings install, and the records that got through."""
    passed: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            passed.append(record.getMessage())

    handler, loggers = Keep(), [logging.getLogger(n) for n in ("celery.worker.strategy", "celery.app.trace")]
    for log in loggers:
        assert any(isinstance(f, PeriodicTaskInfoFilter) for f in log.filters), log.name  # from settings.LOGGING
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    yield (*loggers, passed)
    for log in loggers:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)


def test_celery_lines_of_periodic_ticks_are_dropped_and_the_rest_kept(celery_loggers):
    strategy, trace, passed = celery_loggers
    received = {"id": "1", "name": "rollouts.tick", "args": "()", "kwargs": "{}", "eta": None}
    strategy.info(LOG_RECEIVED, received)
    trace.info(LOG_SUCCESS, {"id": "1", "name": "rollouts.tick", "return_value": "{}", "runtime": 0.004})
    strategy.info(LOG_RECEIVED, {**received, "name": "operations.execute_action", "id": "2"})
    trace.info(LOG_SUCCESS, {"id": "2", "name": "operations.execute_action", "return_value": "'succeeded'",
                             "runtime": 1.5})
    trace.error(LOG_FAILURE, {"id": "3", "name": "operations.reconcile", "exc": "OperationalError('db')",
                              "traceback": "", "args": "()", "kwargs": "{}", "description": "raised unexpected"})
    trace.info("Worker ready: %s", "ops@host")  # a record without a task mapping
    assert passed == [
        "Task operations.execute_action[2] received",
        "Task operations.execute_action[2] succeeded in 1.5s: 'succeeded'",
        "Task operations.reconcile[3] raised unexpected: OperationalError('db')",
        "Worker ready: ops@host",
    ]



def _handlers_emitting(record: logging.LogRecord) -> list[logging.Handler]:
    """The console handlers ``record`` reaches from its logger up the propagation chain, as
    ``Logger.callHandlers`` walks it (pytest's capture handlers, subclasses, are not the console)."""
    found, logger = [], logging.getLogger(record.name)
    while logger is not None:
        found += [h for h in logger.handlers
                  if type(h) is logging.StreamHandler and record.levelno >= h.level and h.filter(record)]
        logger = logger.parent if logger.propagate else None
    return found


def test_a_django_request_warning_is_printed_once(settings):
    """Regression: with DEBUG (make run) each 4xx ("Bad Request: /api/v1/...") was printed twice, by Django's own
    console handler and by the root's."""
    settings.DEBUG = True
    record = logging.getLogger("django.request").makeRecord("django.request", logging.WARNING, __file__, 1,
                                                            "Bad Request: %s", ("/api/v1/pools/",), None)
    assert len(_handlers_emitting(record)) == 1
