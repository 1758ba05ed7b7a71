"""What each iteration of the control plane's long-running loops leaves behind, found with tracemalloc in
seconds instead of a 30-minute soak.

The loops run in this process far faster than real time, with ``DEBUG`` on as ``make run`` runs them:

* ``poller``: ``TelemetryPoller.run`` (scrape, signals, broadcast on the channel layer, Redis history, alerts)
  over two pools (decode and prefill, one ``stable`` replica each) whose workers are real ``WorkerMetrics``
  registries served over HTTP, plus one router's ``RouterMetrics``; the poller's clock advances
  ``--poll-step-s`` per poll and the counters move at every poll;
* ``ticks``: the ``ticks`` Celery worker's two tasks, ``operations.reconcile`` and ``operations.autoscale``, as
  its tracer runs them (``task_prerun``, the task, ``task_postrun``), on an
  :class:`~apps.orchestrators.fake_backend.InstantBackend` fleet of the same two pools.

Each loop runs ``--warmup`` iterations, then tracemalloc snapshots before and after ``--iterations`` more. Printed
per loop: the traced growth in bytes and per iteration, and the largest growths grouped by traceback (the
innermost ``--frames`` frames). ``--without-query-log-reset`` replays the loops as they were before
``apps.core.process_loop`` (Django's query log kept across iterations) to show what the fix removed.

Needs ``DATABASE_URL=postgres://...`` (a throwaway test database is created and dropped) and ``REDIS_URL`` (a
Redis db of your own: the history goes under a prefix of this run, removed at the end; the channel layer and the
routing table use it as they do in the product). Usage::

    nice -n 10 python bench/leak_check.py [--loop poller --loop ticks] [--warmup 50] [--iterations 1000]

Writes ``bench/results/leak_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

LOOPS = ("poller", "ticks")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", action="append", choices=LOOPS, help="loops to check (default: both)")
    parser.add_argument("--warmup", type=int, default=50, help="iterations before the first snapshot")
    parser.add_argument("--iterations", type=int, default=1000, help="iterations between the two snapshots")
    parser.add_argument("--poll-step-s", type=float, default=1.0, help="poller clock advance per poll (seconds)")
    parser.add_argument("--frames", type=int, default=8, help="traceback frames kept per allocation")
    parser.add_argument("--top", type=int, default=8, help="tracebacks printed per loop")
    parser.add_argument("--without-query-log-reset", action="store_true",
                        help="keep Django's query log across iterations (the loops before apps.core.process_loop)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "leak_check.json")
    args = parser.parse_args(argv)
    args.loop = args.loop or list(LOOPS)
    if args.warmup < 1 or args.iterations < 1:
        parser.error("--warmup and --iterations must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.environ.get("DATABASE_URL", "").startswith("postgres") or not os.environ.get("REDIS_URL"):
        print("leak_check needs DATABASE_URL=postgres://... and REDIS_URL (a Redis db of your own)")
        return 2
    from bench.throwaway_db import in_throwaway_database

    return in_throwaway_database(lambda: run(args))


def growth(loop_once, args: argparse.Namespace) -> dict:
    """``loop_once()`` ``--warmup`` times, then the tracemalloc growth over ``--iterations`` more."""
    tracemalloc.start(args.frames)
    try:
        for _ in range(args.warmup):
            loop_once()
        before = tracemalloc.take_snapshot()
        started = time.perf_counter()
        for _ in range(args.iterations):
            loop_once()
        seconds = time.perf_counter() - started
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    after, before = after.filter_traces(ignore), before.filter_traces(ignore)
    total = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    top = []
    for stat in after.compare_to(before, "traceback")[: args.top]:
        frames = [f"{frame.filename.removeprefix(str(ROOT) + '/')}:{frame.lineno}" for frame in stat.traceback]
        top.append({"size_diff": stat.size_diff, "count_diff": stat.count_diff, "traceback": frames})
    return {"iterations": args.iterations, "seconds": round(seconds, 2), "grown_bytes": total,
            "bytes_per_iteration": round(total / args.iterations, 1), "top": top}


@contextlib.contextmanager
def demo_fleet(tag: str):
    """Two pools (names ending ``-<tag>``) with one served worker registry each, one served router registry; yields
    ``(pools, replica endpoints, router endpoints, worker metrics)``."""
    from prometheus_client import start_http_server

    from apps.catalog.services import model_version_register
    from apps.fleet.services import cluster_create, pool_create
    from apps.telemetry.endpoints import ReplicaEndpoint
    from apps.telemetry.services import alert_rules_load_defaults
    from apps.telemetry.testing import served_router_metrics
    from bench.reconcile_scale import CONFIG
    from inference_worker.metrics import WorkerMetrics

    alert_rules_load_defaults()
    version = model_version_register(name=f"leak-check-{tag}", version="v1", weights_uri="s3://bench/none",
                                     sha256="c" * 64, config=CONFIG)
    cluster = cluster_create(name=f"leak-{tag}", kind="local", agent_url="http://fake.invalid:7000",
                             datacenter=f"dc-{tag}")
    pools = [pool_create(name=f"{role}-{tag}", role=role, replicas=1, cluster=cluster, model_version=version)
             for role in ("decode", "prefill")]
    servers, endpoints, metrics = [], [], []
    for pool in pools:
        worker = WorkerMetrics({"pool": pool.name, "track": "stable", "replica": f"{pool.name}-0",
                                "role": pool.role})
        worker.set_ready(True)
        server, _thread = start_http_server(0, addr="127.0.0.1", registry=worker.registry)
        servers.append(server)
        metrics.append(worker)
        endpoints.append(ReplicaEndpoint(str(pool.pk), "stable", f"{pool.name}-0",
                                         f"http://127.0.0.1:{server.server_address[1]}"))
    try:
        with served_router_metrics() as (_router, router_endpoint):
            yield pools, endpoints, [router_endpoint], metrics
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def check_poller(args: argparse.Namespace, history) -> dict:
    from apps.telemetry.poller import TelemetryPoller

    with demo_fleet("poller") as (_pools, endpoints, routers, metrics):
        polls = itertools.count()
        start = time.time()
        poller = TelemetryPoller(history=history, window_s=30.0, interval_s=0.001,
                                 clock=lambda: start + args.poll_step_s * next(polls),
                                 endpoints=lambda: endpoints, routers=lambda: routers)
        stop = threading.Event()
        step = itertools.count()

        def once() -> None:
            n = next(step)
            for worker in metrics:  # the workers keep serving: counters and histograms move at every poll
                worker.set_engine_state(num_waiting=n % 3, num_running=1 + n % 2, kv_cache_usage=(n % 10) / 10,
                                        busy_ratio=0.5)
                worker.request_finished("success")
                worker.tokens(num_prompt_tokens=100 + n % 300, num_generation_tokens=32)
                worker.observe_latency(ttft_s=0.05 + (n % 7) / 50, e2e_s=1.0 + (n % 5) / 10, num_output_tokens=32)
            poller.run(stop, max_polls=1)

        try:
            return growth(once, args)
        finally:
            poller.close()


def check_ticks(args: argparse.Namespace, _history) -> dict:
    from unittest import mock

    from celery.signals import task_postrun, task_prerun

    from apps.operations import reconcile
    from apps.operations.backends import pool_ref
    from apps.operations.tasks import autoscale as autoscale_task
    from apps.operations.tasks import reconcile as reconcile_task
    from apps.orchestrators.fake_backend import InstantBackend

    backend = InstantBackend()
    with demo_fleet("ticks") as (pools, _endpoints, _routers, _metrics):
        for pool in pools:
            backend.seed_track(pool_ref(pool), "stable", version="v1", replicas=1)
        ids = itertools.count()

        def as_a_worker_runs(task) -> None:
            task_id = f"leak-{next(ids)}"
            task_prerun.send(sender=task, task_id=task_id, task=task, args=(), kwargs={})
            result = task()
            task_postrun.send(sender=task, task_id=task_id, task=task, args=(), kwargs={}, retval=result,
                              state="SUCCESS")

        def once() -> None:
            as_a_worker_runs(reconcile_task)
            as_a_worker_runs(autoscale_task)

        with mock.patch.object(reconcile, "backend_for_cluster", lambda cluster: backend):
            return growth(once, args)


def run(args: argparse.Namespace) -> int:
    import logging

    from django.conf import settings

    import controlplane.celery  # noqa: F401 - the worker's task_prerun hook, as in the ticks process
    from apps.core import process_loop
    from apps.telemetry.history import SignalHistory

    logging.getLogger("apps").setLevel(logging.ERROR)
    settings.DEBUG = True
    if args.without_query_log_reset:
        process_loop.reset_queries = lambda: None
    history = SignalHistory(prefix=f"ferry:leak-check-{uuid.uuid4().hex[:8]}:")
    results: dict[str, dict] = {}
    try:
        for loop in args.loop:
            results[loop] = (check_poller if loop == "poller" else check_ticks)(args, history)
    finally:
        history.clear()
    label = "without the query-log reset" if args.without_query_log_reset else "as the product runs"
    for loop, row in results.items():
        print(f"{loop} ({label}, DEBUG on): {row['grown_bytes']} bytes over {row['iterations']} iterations after "
              f"{args.warmup} ({row['bytes_per_iteration']} per iteration, {row['seconds']} s)")
        for top in row["top"]:
            print(f"  {top['size_diff']:>+10} B {top['count_diff']:>+7} blocks  " + " <- ".join(top["traceback"][:3]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "leak_check", "args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
