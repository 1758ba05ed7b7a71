"""Logging filters for Ferry's processes (``controlplane.settings.LOGGING`` installs them).

A Celery worker logs two INFO lines per task it runs (``Task rollouts.tick[...] received`` from
``celery.worker.strategy``, ``Task ... succeeded in 0.004s: {}`` from ``celery.app.trace``). The periodic ticks run
every 1-2 s, so ``make run``'s output was about 180 such lines a minute (762 ``rollouts.tick`` lines in its first
13 minutes, seen in session 11) and buried the lines an operator reads: the ready banner, Actions, errors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

PERIODIC_TASK_NAMES = frozenset({"operations.reconcile", "operations.autoscale", "rollouts.tick",
                                 "telemetry.prune_alerts"})
"""The tasks celery beat starts on an interval: ``ferry_beat_setup.PERIODIC_TASKS`` and
``ferry_setup.EXTRA_PERIODIC_TASKS`` (a test keeps the three in step)."""


class PeriodicTaskInfoFilter(logging.Filter):
    """Drop Celery's per-task INFO records (received, succeeded) of :data:`PERIODIC_TASK_NAMES`.

    Celery passes the task's fields as the record's mapping argument (``{"name": ..., "id": ...}``); records of
    other tasks (``operations.execute_action``: an Action running) and every WARNING or above (a tick that failed
    or was retried) pass. ``LOG_LEVEL=DEBUG`` leaves the filter out (the settings).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or not isinstance(record.args, Mapping):
            return True
        return record.args.get("name") not in PERIODIC_TASK_NAMES
