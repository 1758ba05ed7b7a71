"""Per-request cost of the top API endpoints: pyinstrument profiles and query counts, in-process.

Each endpoint is requested ``--repeat`` times through Django's full stack (middleware, authentication, DRF,
serializers; ``django.test.Client``, so no server and no network) against the database at ``DATABASE_URL``
with an existing user's API token. Per endpoint it reports the mean wall time per request, the SQL queries of
one request (``CaptureQueriesContext``) and writes pyinstrument's text report (``--out-dir``); the JSON
summary goes to ``--out``.

``--asgi N`` also sends each endpoint N times through ASGI applications in-process (no server, no sockets; an
event loop, scope/receive/send as uvicorn passes them): the project's (``controlplane.asgi.application``) and
Django's stock ``ASGIHandler`` (what it replaced), and reports the process's CPU time per request (every thread:
``time.process_time``), the wall time per request and the worker-thread hops (``sync_to_async`` calls) of one
request. The database connections come from a psycopg pool as in the web process (``DATABASE_POOL_MAX_SIZE``,
default 4 here).

    DATABASE_URL=postgres://... python bench/api_profile.py --user operator --out var/bench/api_profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DATABASE_POOL_MAX_SIZE", "4")  # as the web process (controlplane.web)

import django  # noqa: E402

django.setup()

import asgiref.sync  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from pyinstrument import Profiler  # noqa: E402


class HopCounter:
    """Counts ``sync_to_async`` calls (each one hop from the event loop to a worker thread) while installed."""

    def __init__(self):
        self.count = 0
        self._original = asgiref.sync.SyncToAsync.__call__

    def __enter__(self) -> HopCounter:
        original = self._original

        def counted(instance, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.count += 1
            return original(instance, *args, **kwargs)

        asgiref.sync.SyncToAsync.__call__ = counted
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        asgiref.sync.SyncToAsync.__call__ = self._original


async def asgi_get(app, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:  # noqa: ANN001
    """One GET of ``path`` through the ASGI ``app`` as a server sends it: (status, body)."""
    sent: list[dict] = []
    done = asyncio.Event()
    requested = False

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()  # Django listens for the client's disconnect until the response is sent
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    raw_path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": raw_path, "raw_path": raw_path.encode(),
             "query_string": query.encode(), "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)
    done.set()
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def asgi_cost(app, path: str, token: str, repeat: int) -> dict:  # noqa: ANN001
    """CPU and wall milliseconds per request of ``repeat`` sequential GETs of ``path`` through ``app``, and the
    thread hops of one."""
    headers = [(b"host", b"127.0.0.1"), (b"authorization", f"Token {token}".encode())]
    loop = asyncio.new_event_loop()
    try:
        status, body = loop.run_until_complete(asgi_get(app, path, headers))  # warm-up
        with HopCounter() as hops:
            loop.run_until_complete(asgi_get(app, path, headers))
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for _ in range(repeat):
            loop.run_until_complete(asgi_get(app, path, headers))
        cpu_ms = (time.process_time() - cpu_start) / repeat * 1000
        wall_ms = (time.perf_counter() - wall_start) / repeat * 1000
    finally:
        loop.close()
    return {"status": status, "body_bytes": len(body), "cpu_ms": round(cpu_ms, 3), "wall_ms": round(wall_ms, 3),
            "thread_hops": hops.count}

ENDPOINTS = ("/api/v1/pools/", "/api/v1/replicas/", "/api/v1/actions/", "/api/v1/clusters/",
             "/api/v1/model-versions/", "/api/v1/rollouts/", "/api/v1/alerts/", "/api/v1/routing-table/")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--user", default="operator", help="whose API token to send")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--endpoint", action="append", help=f"path (repeatable; default {', '.join(ENDPOINTS)})")
    parser.add_argument("--out", type=Path, default=Path("var/bench/api_profile.json"))
    parser.add_argument("--out-dir", type=Path, default=Path("var/bench/api_profile"))
    parser.add_argument("--asgi", type=int, default=0, metavar="N",
                        help="also N requests per endpoint through the project's and Django's ASGI handlers")
    args = parser.parse_args(argv)
    from django.contrib.auth import get_user_model

    from apps.accounts.services import api_token_create

    # API tokens are stored hashed (knox): a new one for this run, the clear value only exists here.
    token = api_token_create(user=get_user_model().objects.get(username=args.user))
    client = Client(HTTP_AUTHORIZATION=f"Token {token}", HTTP_HOST="127.0.0.1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for path in args.endpoint or ENDPOINTS:
        status = client.get(path).status_code  # warm-up (imports, caches)
        with CaptureQueriesContext(connection) as queries:
            client.get(path)
        sql = [q["sql"][:200] for q in queries.captured_queries]  # now: a reconnect clears the query log
        profiler = Profiler(interval=0.0005)
        start = time.perf_counter()
        with profiler:
            for _ in range(args.repeat):
                client.get(path)
        mean_ms = (time.perf_counter() - start) / args.repeat * 1000
        name = path.strip("/").replace("/", "_")
        (args.out_dir / f"{name}.txt").write_text(profiler.output_text(unicode=False, color=False))
        results[path] = {"status": status, "mean_ms": round(mean_ms, 2), "num_queries": len(sql), "queries": sql}
        print(f"{path:28s} {status} {mean_ms:7.2f} ms/request {len(sql):3d} queries", flush=True)
        if args.asgi:
            from django.core.handlers.asgi import ASGIHandler

            from controlplane.asgi import application

            results[path]["asgi"] = {}
            for name, app in (("project", application), ("django_stock", ASGIHandler())):
                cost = asgi_cost(app, path, token, args.asgi)
                results[path]["asgi"][name] = cost
                print(f"{'':28s} ASGI {name:12s} {cost['status']} {cost['cpu_ms']:7.2f} ms CPU "
                      f"{cost['wall_ms']:7.2f} ms wall per request, {cost['thread_hops']} thread hops", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeat": args.repeat, "loadavg": os.getloadavg(), "endpoints": results},
                                   indent=2) + "\n")


if __name__ == "__main__":
    main()
