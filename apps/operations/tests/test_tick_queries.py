"""A reconcile tick and an autoscale tick cost the same number of SQL statements for 3 pools as for 30.

The ticks batch their database work (one query per kind of row, not per pool) so that 1,000 pools stay under
the tick interval (``bench/reconcile_scale.py``). The backend is :class:`InstantBackend` (in process); each
pool's telemetry keeps it at its size, so a steady tick requests no Action. Also: the batched refresh of
observed replicas writes what the one-row-at-a-time ``update_or_create`` wrote.
"""

import time
from datetime import UTC, datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.fleet.models import Replica
from apps.fleet.services import replicas_refresh, replicas_refresh_many
from apps.operations import reconcile
from apps.operations.autoscale import autoscale_all
from apps.operations.backends import pool_ref
from apps.operations.models import Action, AutoscalerState
from apps.orchestrators.base import ObservedReplica, ObservedState, ObservedTrack
from apps.orchestrators.fake_backend import InstantBackend

pytestmark = pytest.mark.django_db

RECONCILE_QUERIES = 19
"""Leases to take over, stale pending Actions; pools, tracks, model versions; in a savepoint the replica rows and
one ``last_seen`` update (4 with the savepoint's 2); busy pools, recent restarts; the routing table's pools,
tracks, ready replicas, links, client keys, and its row in a savepoint (3)."""
AUTOSCALE_QUERIES = 5
"""Pools, tracks, busy pools, ``AutoscalerState`` rows, and their one bulk update."""


def _grow(make_pool, backend, history, names):
    pools = [make_pool(name=name, replicas=2, autoscaling_enabled=True, min_replicas=1, max_replicas=8,
                       autoscaling_target=4.0) for name in names]
    now = time.time()
    for pool in pools:
        backend.seed_track(pool_ref(pool), "stable", version="v1", replicas=2)
        history.append(f"pool:{pool.pk}", now, {"at": now, "signals": {"num_requests_waiting": 8.0,
                                                                        "ready_replicas": 2},
                                                 "ejections": {f"{pool.name}-stable-0": 1.0}})
    return pools


def _tick_queries(history) -> tuple[int, int]:
    reconcile.reconcile_all(history=history)  # the first sees new replicas / new routing content
    autoscale_all(history=history)  # the first creates the AutoscalerState rows
    with CaptureQueriesContext(connection) as steady_reconcile:
        result = reconcile.reconcile_all(history=history)
    with CaptureQueriesContext(connection) as steady_autoscale:
        counts = autoscale_all(history=history)
    assert (result.applies, result.restarts, result.pools_unreachable, counts["requested"]) == (0, 0, 0, 0)
    return len(steady_reconcile), len(steady_autoscale)


def test_a_tick_runs_as_many_queries_for_30_pools_as_for_3(make_pool, history, monkeypatch):
    backend = InstantBackend()
    monkeypatch.setattr(reconcile, "backend_for_cluster", lambda cluster: backend)
    _grow(make_pool, backend, history, [f"p{i}" for i in range(3)])
    few = _tick_queries(history)
    _grow(make_pool, backend, history, [f"p{i}" for i in range(3, 30)])
    many = _tick_queries(history)
    assert Replica.objects.count() == 60
    assert AutoscalerState.objects.count() == 30
    assert not Action.objects.exists()
    assert few == many == (RECONCILE_QUERIES, AUTOSCALE_QUERIES)
    assert backend.calls == {"observe": 2 * 3 + 2 * 30}


def _replica(name, **fields):
    values = {"track": "stable", "endpoint": f"http://127.0.0.1:9{name[-1]}00", "ready": True, "alive": True,
              "version": "v1"} | fields
    return ObservedReplica(name=name, **values)


def _state(pool, *replicas):
    return ObservedState(pool_name=pool.name, tracks={"stable": ObservedTrack("stable", len(replicas), 0, replicas)})


def test_batched_refresh_creates_updates_and_deletes_rows_like_one_row_at_a_time(make_pool):
    a, b = make_pool(name="a"), make_pool(name="b")
    assert replicas_refresh_many(observed={a.pk: _state(a, _replica("a-0"), _replica("a-1")),
                                           b.pk: _state(b, _replica("b-0"))}) == (3, 0)
    before = {r.name: r for r in Replica.objects.all()}
    died = datetime(2026, 12, 1, 12, 0, 0, 250000, tzinfo=UTC)
    # a-0 died with a message, a-1 vanished, a-2 is new; b is not refreshed: its row stays as it was
    assert replicas_refresh(pool=a, observed=_state(a, _replica("a-0", alive=False, ready=True, exit_code=3,
                                                                   restart_count=2, message="no weights",
                                                                   exited_at=died.timestamp()),
                                                      _replica("a-2", ready=False))) == (2, 1)
    rows = {r.name: r for r in Replica.objects.all()}
    assert sorted(rows) == ["a-0", "a-2", "b-0"]
    dead = rows["a-0"]
    assert (dead.ready, dead.alive, dead.exit_code, dead.restart_count, dead.message, dead.exited_at) == (
        False, False, 3, 2, "no weights", died)
    assert dead.pk == before["a-0"].pk and dead.first_seen == before["a-0"].first_seen
    assert dead.last_seen > before["a-0"].last_seen
    assert (rows["a-2"].ready, rows["a-2"].alive, rows["a-2"].endpoint) == (False, True, "http://127.0.0.1:9200")
    assert rows["b-0"].last_seen == before["b-0"].last_seen
