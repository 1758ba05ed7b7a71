"""``python -m controlplane.web``: the ``web`` process — Django's ASGI app (HTTP: dashboard, REST API, admin;
WebSocket: Channels) under uvicorn with several worker processes on one port.

Why uvicorn with processes: under ASGI Django runs sync views in asgiref threads (``sync_to_async``) under
one GIL, so one daphne process uses at most one core.
uvicorn's supervisor forks ``--workers`` processes that share the listening socket; each is a full ASGI
server, so WebSockets (the ``websockets`` library) and HTTP stay on one port and one origin (no proxy needed
under ``make run``). Measured in ``bench/api_load.py`` (README, "Architecture"). Each worker runs uvloop's
event loop and httptools' HTTP parser (C; uvicorn's defaults without them are asyncio's loop and h11, pure Python),
and Django's middleware chain in one worker-thread hop per request (:mod:`apps.core.asgi_handler`).

Worker count: ``--workers`` if given, else ``FERRY_WEB_WORKERS``, else :func:`default_web_workers` of the cores
this process may run on (``os.sched_getaffinity``: a container's cpuset, not the host's cores). The access
log goes to ``--access-log FILE`` (appended by every worker) or nowhere. Each worker keeps a psycopg connection
pool of ``DATABASE_POOL_MAX_SIZE`` (environment, default :data:`DATABASE_POOL_MAX_SIZE`) connections.

Exit: SIGTERM/SIGINT stop the supervisor, which stops its workers (uvicorn's graceful shutdown, bounded by
``--timeout-graceful-shutdown``).
"""

from __future__ import annotations

import argparse
import copy
import os

import uvicorn
from uvicorn.config import LOGGING_CONFIG

APP = "controlplane.asgi:application"
MAX_DEFAULT_WORKERS = 8
DATABASE_POOL_MAX_SIZE = 4
"""PostgreSQL connections per worker process: requests in flight beyond it wait for one (up to the pool's 10 s
timeout, then 503)."""
WORKER_HEALTHCHECK_TIMEOUT_S = 30
"""Seconds uvicorn's supervisor waits for a worker to answer its health ping before killing it (uvicorn's default:
5). The answer comes from a thread of the worker that needs the GIL, which every request in flight also wants
(each runs its sync view on a thread of its own, :mod:`apps.core.asgi_handler`): under overload on a small machine a
busy, healthy worker answered after more than 5 s and was killed, cutting every connection it held, so an overload
turned into connection errors and a cold worker (issue 21's load runs). 30 s still replaces a worker that is really
hung; its requests time out at the client meanwhile."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity set; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def default_web_workers(cores: int) -> int:
    """Web worker processes for ``cores`` cores: ``cores + 1``, at least 2, at most ``MAX_DEFAULT_WORKERS``.

    One more process than cores keeps a core busy while another process waits on PostgreSQL or Redis
    (each process runs its sync views on one thread); the cap bounds memory (~100 MiB per process).
    """
    return max(2, min(MAX_DEFAULT_WORKERS, cores + 1))


def web_workers(arg: int | None, environ: dict[str, str]) -> int:
    """The worker count: ``arg``, else ``FERRY_WEB_WORKERS``, else :func:`default_web_workers`.

    Raises:
        ValueError: the count (argument or environment) is not an integer >= 1.
    """
    raw = arg if arg is not None else environ.get("FERRY_WEB_WORKERS") or None
    if raw is None:
        return default_web_workers(available_cores())
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"FERRY_WEB_WORKERS must be an integer >= 1, got {raw!r}") from None
    if count < 1:
        raise ValueError(f"the web worker count must be >= 1, got {count}")
    return count


def log_config(access_log: str | None) -> dict:
    """uvicorn's logging config with the access log written to ``access_log`` (a file), or dropped."""
    config = copy.deepcopy(LOGGING_CONFIG)
    if access_log:
        config["handlers"]["access"] = {"class": "logging.FileHandler", "formatter": "access",
                                        "filename": access_log, "mode": "a"}
        config["formatters"]["access"]["use_colors"] = False
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m controlplane.web", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes (default: FERRY_WEB_WORKERS, else cores + 1, 2..8)")
    parser.add_argument("--access-log", default=None, help="append the access log to this file (default: none)")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info").lower())
    args = parser.parse_args(argv)
    try:
        workers = web_workers(args.workers, dict(os.environ))
    except ValueError as exc:
        parser.error(str(exc))
    # each worker process reuses up to this many PostgreSQL connections (controlplane.settings)
    os.environ.setdefault("DATABASE_POOL_MAX_SIZE", str(DATABASE_POOL_MAX_SIZE))
    if args.access_log:
        os.makedirs(os.path.dirname(os.path.abspath(args.access_log)), exist_ok=True)
    # uvloop and httptools (C) instead of asyncio's loop and h11 (pure Python): less CPU per request
    uvicorn.run(APP, host=args.host, port=args.port, workers=workers, lifespan="off", ws="websockets-sansio",
                loop="uvloop", http="httptools",
                log_config=log_config(args.access_log), access_log=bool(args.access_log),
                log_level=args.log_level, timeout_graceful_shutdown=10, proxy_headers=False,
                timeout_worker_healthcheck=WORKER_HEALTHCHECK_TIMEOUT_S)


if __name__ == "__main__":
    main()
