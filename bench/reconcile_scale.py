"""Reconcile and autoscale ticks at fleet scale: 1,000 pools and 10,000 replicas on an instant backend.

What one tick costs Ferry itself — PostgreSQL, Redis and Python — with the orchestrator taken out: every
cluster's backend is :class:`apps.orchestrators.fake_backend.InstantBackend` (in process, answers at once),
put in place of :func:`apps.operations.backends.backend_for_cluster` for the reconcile tick. The fleet:
``--pools`` pools (default 1,000) spread over ``--clusters`` local clusters, each pool one ``stable`` track of
``--replicas-per-pool`` replicas (default 10), every one running in the backend already, autoscaling on
(``num_requests_waiting``, target 4) with a telemetry record per ``--record-interval-s`` over the last
``--history-s`` seconds in Redis whose queue keeps the pool at its size (no scale is decided), and router
ejection counters that do not move (no restart is decided).

Measured, each with wall time (``time.perf_counter``), this process's CPU time (``time.process_time``:
PostgreSQL's and Redis' own work is not in it) and the SQL queries it ran (an execute
wrapper on the connection):

* reconcile, first tick: every ``Replica`` row is new (the fleet was just started);
* reconcile, steady ticks (``--ticks``, median reported): nothing changed but ``last_seen``;
* autoscale, first tick (every ``AutoscalerState`` row is new) and steady ticks.

Targets (issue 21): a steady reconcile tick under 2 s, a steady autoscale tick under 1 s, on PostgreSQL.

Needs ``DATABASE_URL=postgres://...``: a throwaway test database (``test_<name>``) is created and dropped, the
database itself is never written. Needs ``REDIS_URL`` (use a db of your own): telemetry records go under a
prefix of this run and are deleted at the end; the tick also stores the routing table in
``ferry:routing-table`` there, as every reconcile tick does. Usage::

    python bench/reconcile_scale.py [--pools 1000] [--replicas-per-pool 10] [--history-s 60]

Prints a table and writes ``bench/results/reconcile_scale.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

CONFIG = {"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
          "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
          "max_position_embeddings": 32768, "sliding_window": 512}
RECONCILE_TARGET_S = 2.0
AUTOSCALE_TARGET_S = 1.0
PROFILE = bool(os.environ.get("RECONCILE_SCALE_PROFILE"))  # print a pyinstrument profile of every tick


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument("--clusters", type=int, default=10)
    parser.add_argument("--replicas-per-pool", type=int, default=10)
    parser.add_argument("--history-s", type=float, default=60.0,
                        help="seconds of telemetry history per pool in Redis (the ejection check reads up to "
                             "FERRY_EJECTION_RESTART_WINDOW_S of it)")
    parser.add_argument("--record-interval-s", type=float, default=5.0, help="seconds between telemetry records")
    parser.add_argument("--ticks", type=int, default=3, help="steady ticks of each kind (median reported)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reconcile_scale.json")
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        print("reconcile_scale needs DATABASE_URL=postgres://... (a test database is created there and dropped)")
        return 2
    if not os.environ.get("REDIS_URL"):
        print("reconcile_scale needs REDIS_URL (a Redis db of your own)")
        return 2

    from bench.throwaway_db import in_throwaway_database

    return in_throwaway_database(lambda: run(args))


def build_fleet(args: argparse.Namespace, backend) -> list:
    """Clusters, pools and tracks in bulk (the services validate one row at a time: minutes for 1,000)."""
    from apps.catalog.services import model_version_register
    from apps.fleet.models import Pool, PoolTrack
    from apps.fleet.services import cluster_create
    from apps.operations.backends import pool_ref

    version = model_version_register(name="bench-scale-model", version="v1", weights_uri="s3://bench/none",
                                     sha256="b" * 64, config=CONFIG)
    clusters = [cluster_create(name=f"bench-c{i}", kind="local", agent_url=f"http://fake.invalid:{7000 + i}",
                               datacenter=f"dc-{i}") for i in range(args.clusters)]
    pools = Pool.objects.bulk_create([
        Pool(name=f"pool-{i:05d}", cluster=clusters[i % len(clusters)], role="decode", model_version=version,
             autoscaling_enabled=True, min_replicas=1, max_replicas=4 * args.replicas_per_pool,
             autoscaling_signal="num_requests_waiting", autoscaling_target=4.0, drain_timeout_s=30)
        for i in range(args.pools)
    ])
    PoolTrack.objects.bulk_create([
        PoolTrack(pool=pool, name="stable", model_version=version, replicas=args.replicas_per_pool, weight=100,
                  active=True)
        for pool in pools
    ])
    for pool in Pool.objects.select_related("cluster"):
        backend.seed_track(pool_ref(pool), "stable", version="v1", replicas=args.replicas_per_pool)
    return pools


def fill_history(args: argparse.Namespace, pools: list, history) -> int:
    """Telemetry records as the poller writes them: the queue at target, steady ejection counters."""
    now = time.time()
    count = max(1, int(args.history_s // args.record_interval_s))
    n = args.replicas_per_pool
    records = []
    for pool in pools:
        ejections = {f"{pool.name}-stable-0": 1.0}  # ejected once long ago: a counter that no longer moves
        for k in range(count):
            at = now - (count - 1 - k) * args.record_interval_s
            signals = {"num_requests_waiting": 4.0 * n, "ready_replicas": n, "request_rate_per_s": 2.0 * n,
                       "kv_cache_usage": 0.4, "engine_busy_ratio": 0.5, "ttft_p99_s": 0.2, "tpot_p99_s": 0.03}
            records.append((f"pool:{pool.pk}", at, {
                "pool_id": pool.pk, "at": at, "window_s": 30.0, "source": "scrape", "seq": k + 1,
                "signals": signals, "tracks": {"stable": signals}, "ejections": ejections}))
    return history.append_many(records)


def measure(fn) -> dict:
    """Wall time and SQL statements of ``fn()`` (counted by an execute wrapper: no 9,000-query log cap)."""
    from django.db import connection

    count = 0

    def counter(execute, sql, params, many, context):
        nonlocal count
        count += 1
        return execute(sql, params, many, context)

    with connection.execute_wrapper(counter):
        start, cpu = time.perf_counter(), time.process_time()
        if PROFILE:
            from pyinstrument import Profiler

            with Profiler() as profiler:
                out = fn()
            print(profiler.output_text(color=False, show_all=False)[:6000])
        else:
            out = fn()
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu_s, "queries": count, "result": out}


def run(args: argparse.Namespace) -> int:
    import logging
    from unittest import mock

    from django.conf import settings

    from apps.fleet.models import Replica
    from apps.operations import reconcile
    from apps.operations.autoscale import autoscale_all
    from apps.operations.models import Action, AutoscalerState
    from apps.orchestrators.fake_backend import InstantBackend
    from apps.telemetry.history import SignalHistory

    logging.getLogger("apps.operations").setLevel(logging.WARNING)
    settings.DEBUG = False
    backend = InstantBackend()
    history = SignalHistory(prefix=f"ferry:bench-reconcile-{uuid.uuid4().hex[:8]}:")
    started = time.perf_counter()
    pools = build_fleet(args, backend)
    records = fill_history(args, pools, history)
    setup_s = time.perf_counter() - started
    print(f"fleet: {len(pools)} pools, {len(pools) * args.replicas_per_pool} replicas on {args.clusters} clusters, "
          f"{records} telemetry records ({records // len(pools)} per pool); set up in {setup_s:.1f} s")

    rows: dict[str, dict] = {}
    try:
        with mock.patch.object(reconcile, "backend_for_cluster", lambda cluster: backend):
            tick = functools.partial(reconcile.reconcile_all, history=history)
            rows["reconcile first tick"] = measure(tick)
            rows["reconcile steady tick"] = median_row([measure(tick) for _ in range(args.ticks)])
            autoscale = functools.partial(autoscale_all, history=history)
            rows["autoscale first tick"] = measure(autoscale)
            rows["autoscale steady tick"] = median_row([measure(autoscale) for _ in range(args.ticks)])
        checks = {
            "replica_rows": Replica.objects.count(),
            "autoscaler_states": AutoscalerState.objects.count(),
            "actions": Action.objects.count(),
            "observe_calls": backend.calls.get("observe", 0),
        }
    finally:
        keys = list(history.client.scan_iter(match=f"{history.prefix}*", count=1000))
        for i in range(0, len(keys), 1000):
            history.client.delete(*keys[i:i + 1000])

    expected_replicas = len(pools) * args.replicas_per_pool
    print(f"{'tick':<24} {'wall s':>8} {'cpu s':>7} {'queries':>8} {'target s':>9} {'wall/target':>12}")
    for label, row in rows.items():
        target = RECONCILE_TARGET_S if label.startswith("reconcile") else AUTOSCALE_TARGET_S
        row["target_s"] = target
        print(f"{label:<24} {row['seconds']:>8.3f} {row['cpu_seconds']:>7.3f} {row['queries']:>8d} {target:>9.1f} "
              f"{row['seconds'] / target:>12.2f}")
    print(f"checks: {checks['replica_rows']} replica rows (expected {expected_replicas}), "
          f"{checks['autoscaler_states']} autoscaler states, {checks['actions']} actions (expected 0), "
          f"{checks['observe_calls']} observe calls")
    ok = checks["replica_rows"] == expected_replicas and checks["actions"] == 0
    load = os.getloadavg()
    print(f"load average: {load[0]:.1f} (1 min) on {os.cpu_count()} CPUs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "reconcile_scale", "pools": len(pools), "replicas": expected_replicas,
        "clusters": args.clusters, "telemetry_records_per_pool": records // len(pools),
        "load_average_1m": load[0], "cpus": os.cpu_count(), "checks": checks,
        "ticks": {label: {k: v for k, v in row.items() if k != "result"} | {"result": row["result"]}
                  for label, row in rows.items()},
    }, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0 if ok else 1


def median_row(rows: list[dict]) -> dict:
    """The tick with the median wall time, with every tick's seconds alongside."""
    ordered = sorted(rows, key=lambda r: r["seconds"])
    row = dict(ordered[len(ordered) // 2])
    row["all_seconds"] = [round(r["seconds"], 4) for r in rows]
    row["median_seconds"] = statistics.median(r["seconds"] for r in rows)
    return row


if __name__ == "__main__":
    sys.exit(main())
