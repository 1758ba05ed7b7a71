"""Dashboard latency: a worker metric changes -> 50 websocket clients of the pool page see the new value.

Path measured: a worker's ``/metrics`` gauge changes (``ferry_num_requests_waiting`` on a real
``inference_worker.metrics`` registry served over HTTP) -> the telemetry poller scrapes it on its next
tick and broadcasts ``telemetry.signals`` to the pool's channel-layer group (Redis) -> the web server's
``PoolConsumer`` instances forward it (``--server web``, the default: ``python -m controlplane.web``, uvicorn with
its worker processes as ``make run`` runs it, the clients spread over them by the kernel; ``--server daphne``: one
daphne process, the server before issue 21) -> each of ``--clients`` websocket clients (the ``websockets``
library, signed in with a session cookie, as a browser tab is) receives the message carrying the new
value. Latency = receive time - change time, on this host's clock; one sample per client per change.

The poll interval bounds the figure from below (a change waits for the next scrape: on average half
the interval), so two more columns separate the parts:

* ``poll -> client``: receive time - the record's ``at`` (the instant the poll began): scrape,
  signal computation, broadcast and websocket delivery;
* reference in the same run: one plain channel-layer subscriber of the same group (no daphne, no
  websocket): the telemetry layer's own change -> subscriber latency. ``ratio`` = websocket clients'
  p95 / reference p95 is what the dashboard path adds on top of the telemetry layer.

Needs Postgres (``DATABASE_URL``; a throwaway test database is created and dropped) and Redis
(``REDIS_URL``). Usage: ``python bench/dashboard_latency.py [--clients 50] [--changes 20] [--interval 1.0]``.
Writes bench/results/dashboard_latency.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--interval", type=float, default=1.0, help="Telemetry poll interval, seconds.")
    parser.add_argument("--server", choices=("web", "daphne"), default="web",
                        help="web: python -m controlplane.web (make run's server); daphne: one daphne process")
    parser.add_argument("--workers", type=int, default=None, help="web worker processes (default: as make run)")
    args = parser.parse_args()
    if args.clients < 1 or args.changes < 1 or args.interval <= 0:
        parser.error("--clients and --changes must be >= 1 and --interval > 0")
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        print("dashboard_latency needs DATABASE_URL=postgres://... (daphne runs as a separate process)")
        return 2

    from bench.throwaway_db import in_throwaway_database

    return in_throwaway_database(lambda: run(args))


def session_cookie(user) -> str:
    """A signed-in session for ``user`` (what the login page creates), as a Cookie header value."""
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.sessions.backends.db import SessionStore

    session = SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.create()
    return f"{settings.SESSION_COOKIE_NAME}={session.session_key}"


def run(args: argparse.Namespace) -> int:
    import logging

    from django.db import connections
    from prometheus_client import start_http_server

    from apps.accounts.services import user_create_with_role
    from apps.catalog.services import model_version_register
    from apps.dashboard.tests.live_stack import Daphne, WebServer
    from apps.fleet.services import cluster_create, pool_create
    from apps.telemetry.endpoints import ReplicaEndpoint
    from apps.telemetry.history import SignalHistory
    from apps.telemetry.poller import TelemetryPoller
    from inference_worker.metrics import WorkerMetrics

    logging.getLogger("apps.telemetry").setLevel(logging.ERROR)
    config = {"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
              "max_position_embeddings": 32768, "sliding_window": 512}
    SignalHistory().clear()
    user = user_create_with_role(username="bench-viewer", role="viewer").user
    version = model_version_register(name="bench-model", version="v1", weights_uri="s3://bench/none",
                                     sha256="a" * 64, config=config)
    cluster = cluster_create(name="bench-local", kind="local", agent_url="http://127.0.0.1:9", datacenter="dc1")
    pool = pool_create(name="bench-decode", cluster=cluster, role="decode", model_version=version, replicas=1)
    cookie = session_cookie(user)

    metrics = WorkerMetrics({"pool": pool.name, "track": "stable", "replica": "r0", "role": "decode"})
    metrics.set_ready(True)
    metrics.set_engine_state(num_waiting=0, num_running=0, kv_cache_usage=0.0, busy_ratio=0.0)
    exporter, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    endpoint = ReplicaEndpoint(str(pool.pk), "stable", "r0", f"http://127.0.0.1:{exporter.server_address[1]}")
    tmp = Path(tempfile.mkdtemp(prefix="ferry-dashboard-bench-"))
    daphne = (WebServer(tmp, args.workers) if args.server == "web" else Daphne(tmp)).start()
    poller = TelemetryPoller(window_s=10.0, interval_s=args.interval, endpoints=lambda: [endpoint])
    stop = threading.Event()

    def poll() -> None:
        try:
            poller.run(stop)
        finally:
            connections.close_all()  # so the throwaway database can be dropped

    poll_thread = threading.Thread(target=poll, daemon=True)
    poll_thread.start()
    try:
        result = asyncio.run(measure(args, pool.pk, daphne.port, cookie, metrics))
    finally:
        stop.set()
        poll_thread.join(10)
        poller.close()
        daphne.stop()
        exporter.shutdown()
        SignalHistory().clear()
    return report(args, result)


async def measure(args: argparse.Namespace, pool_id: int, port: int, cookie: str, metrics) -> dict:
    import websockets
    from channels.layers import get_channel_layer

    from apps.telemetry.broadcast import pool_group

    changes: dict[float, float] = {}  # value -> time it was set
    ws_latency: list[float] = []
    ws_poll_to_client: list[float] = []
    ref_latency: list[float] = []
    done = asyncio.Event()

    def sample(msg: dict, into: list[float], poll_into: list[float] | None, seen: set[float]) -> None:
        now = time.time()
        value = (msg.get("signals") or {}).get("num_requests_waiting")
        if value in changes and value not in seen:
            seen.add(value)
            into.append(now - changes[value])
            if poll_into is not None:
                poll_into.append(now - msg["at"])

    async def client() -> None:
        seen: set[float] = set()
        async with websockets.connect(f"ws://127.0.0.1:{port}/ws/pools/{pool_id}/", max_size=None,
                                      additional_headers={"Cookie": cookie, "Origin": f"http://127.0.0.1:{port}"},
                                      open_timeout=60) as ws:
            connected.append(1)
            while not done.is_set():
                try:
                    raw = await asyncio.wait_for(ws.recv(), 1.0)
                except TimeoutError:
                    continue
                msg = json.loads(raw)
                if msg.get("type") == "telemetry.signals":
                    sample(msg, ws_latency, ws_poll_to_client, seen)

    async def reference() -> None:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(pool_group(pool_id), channel)
        seen: set[float] = set()
        try:
            while not done.is_set():
                try:
                    msg = await asyncio.wait_for(layer.receive(channel), 1.0)
                except TimeoutError:
                    continue
                if msg.get("type") == "telemetry.signals":
                    sample(msg, ref_latency, None, seen)
        finally:
            await layer.group_discard(pool_group(pool_id), channel)

    connected: list[int] = []
    tasks = [asyncio.create_task(client()) for _ in range(args.clients)] + [asyncio.create_task(reference())]
    deadline = time.monotonic() + 120
    while len(connected) < args.clients:
        if time.monotonic() > deadline or any(t.done() for t in tasks):
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()
            raise RuntimeError(f"only {len(connected)} of {args.clients} websocket clients connected")
        await asyncio.sleep(0.1)
    await asyncio.sleep(2 * args.interval)  # every client has its snapshot and a live message
    rng = random.Random(0)
    for i in range(1, args.changes + 1):
        await asyncio.sleep(rng.uniform(0.5, 1.0) * args.interval)  # changes land anywhere in a poll period
        changes[float(i)] = time.time()
        metrics.set_engine_state(num_waiting=i, num_running=0, kv_cache_usage=0.0, busy_ratio=0.0)
        await asyncio.sleep(2 * args.interval)
    await asyncio.sleep(3 * args.interval)
    done.set()
    await asyncio.gather(*tasks)
    return {"ws": ws_latency, "ws_poll": ws_poll_to_client, "ref": ref_latency}


def report(args: argparse.Namespace, result: dict) -> int:
    expected = args.clients * args.changes
    rows = [("websocket clients: change -> client", result["ws"]),
            ("websocket clients: poll -> client", result["ws_poll"]),
            ("reference channel-layer subscriber: change -> subscriber", result["ref"])]
    table = {}
    print(f"\ndashboard latency ({args.server}): {args.clients} websocket clients, {args.changes} metric changes, "
          f"poll interval {args.interval:g} s")
    print(f"{'path':58} {'samples':>8} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for name, values in rows:
        if not values:
            print(f"{name:58} {0:>8} (no samples)")
            continue
        stats = {q: percentile(values, q) * 1000 for q in (50, 95, 99)}
        stats["max"] = max(values) * 1000
        table[name] = {"samples": len(values), **{f"p{q}_ms" if q != "max" else "max_ms": round(v, 2)
                                                  for q, v in stats.items()}}
        print(f"{name:58} {len(values):>8} {stats[50]:>9.1f} {stats[95]:>9.1f} {stats[99]:>9.1f} {stats['max']:>9.1f}")
    ratio = (percentile(result["ws"], 95) / percentile(result["ref"], 95)) if result["ws"] and result["ref"] else None
    if ratio is not None:
        print(f"ratio p95 websocket clients / reference subscriber: {ratio:.2f}")
    missing = expected - len(result["ws"])
    if missing:
        print(f"WARNING: {missing} of {expected} (client, change) samples never arrived")
    out = ROOT / "bench" / "results" / "dashboard_latency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"server": args.server, "workers": args.workers, "load_average": os.getloadavg(),
                               "clients": args.clients, "changes": args.changes, "poll_interval_s": args.interval,
                               "expected_samples": expected, "paths": table, "ratio_p95_ws_over_reference": ratio},
                              indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if not missing else 1


if __name__ == "__main__":
    sys.exit(main())
