"""What Django does around each request, for the long-running processes that serve none.

Django resets two pieces of per-connection state when a request starts (``request_started``):
``reset_queries`` empties the connection's query log, which every query appends to while ``DEBUG`` is on
(``BaseDatabaseWrapper.queries_log``, a ``deque`` of up to 9,000 ``{"sql", "time"}`` entries: ~1 KiB each for
the batched reconcile and poller queries, ~9 MiB per process when full), and ``close_old_connections`` drops
an expired or broken connection. A loop outside requests gets neither, so with ``DEBUG`` on (``make run``
sets it) its query log fills for hours: the telemetry poller and the reconcile ticks grew ~1 MiB per 5 minutes
in the 30-minute soak (``bench/chaos.py --soak``). Celery's Django fix-up closes connections around tasks but
keeps the log (it only warns that ``DEBUG`` leaks).

Every such loop calls :func:`loop_iteration_started` at the top of each iteration: the telemetry poller
(``TelemetryPoller.run``), ``ferry_prometheus_targets --interval``, each Celery task (``task_prerun`` in
:mod:`controlplane.celery`: the ``ticks`` and ``worker`` processes) and celery beat's scheduler
(:class:`controlplane.beat.Scheduler`).
"""

from __future__ import annotations

from django.db import close_old_connections, reset_queries


def loop_iteration_started() -> None:
    """Start one iteration of a long-running loop as Django starts a request: empty the query log of this
    thread's connections, then close the ones past ``CONN_MAX_AGE`` or unusable (the next query reconnects)."""
    reset_queries()
    close_old_connections()
