"""What ``make run`` runs: the launcher's settings, the environment every child gets, and the Procfile.

Pure functions (no processes started here), so the process list and the environment are tested as data:

- :func:`child_env` — the environment of every child: ``REDIS_URL`` and ``DATABASE_URL`` (given or
  embedded), the agent and service tokens, ``DEBUG`` on unless set, the demo's remote-prefill threshold and worker settings
  (one torch thread per worker per four cores, a 256 MiB KV cache, KV links capped at 10 Gbit/s), the
  router's metrics URL for the telemetry poller (router decisions per pool), each only when not already
  set, and the per-link KV secret always in the workers' environment;
- :func:`procfile` — one line per process, each ``exec``-ed so honcho's SIGTERM reaches the program
  itself: ``web`` (:mod:`controlplane.web`: the ASGI app under uvicorn, one worker process per core plus one,
  ``FERRY_WEB_WORKERS`` overrides; decided at start from the cores it may use, so the generated manifests carry
  no host's core count), ``worker`` (Celery: Actions, rollouts), ``ticks`` (Celery:
  reconcile and autoscale on their own queue, never queued behind a long Action), ``beat``,
  ``telemetry`` (the poller), ``agent`` (the local agent; it owns the model workers, which reconcile
  starts through the local backend), ``router`` (pulls the routing table from ``web`` with the service
  token) and, with ``load``, ``load`` (bench/serve_load.py against the router, bounded, in a loop, from the moment the launcher
  reports ready: ``<var>/ready``; multi-turn sessions from ``bench/workloads.py``, so prefix-cache hits and
  cache-aware routing show under load; every round has new session ids and prompts, so new sessions keep arriving
  at the router's sticky track split, as real traffic's do).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parents[2]
TOKEN_NAMES = ("FERRY_AGENT_TOKEN", "FERRY_SERVICE_TOKEN", "FERRY_KV_LINK_SECRET", "FERRY_CLIENT_API_KEY")
DEMO_REMOTE_PREFILL_THRESHOLD_TOKENS = 256
DEMO_LINK_BANDWIDTH_GBPS = 10  # the demo's emulated WAN between dc-prefill and dc-decode (apps.setup.demo)
# LOAD=1: each round runs this many new sessions (ids ``round<n>-session-<i>``) of this many turns, so sessions
# keep arriving and the router's sticky track split sends some to a canary of any weight within seconds
LOAD_SESSIONS, LOAD_TURNS = 12, 2
DEMO_WORKER_EXTRA_ARGS = f"--max-num-seqs 8 --kv-cache-memory 256MiB --kv-bandwidth-gbps {DEMO_LINK_BANDWIDTH_GBPS}"


@dataclass(frozen=True)
class LaunchConfig:
    """Where everything listens and what to start."""

    host: str = "127.0.0.1"
    """Address of the web server and the router (the agent and Redis stay on loopback)."""
    port: int = 8000
    """Web (dashboard, API, admin) port."""
    router_port: int = 8080
    """Router (OpenAI API) port."""
    agent_port: int = 8100
    """Local agent port."""
    workers: bool = True
    """Start model workers (demo pools at 1 replica each); False: demo pools at 0 replicas."""
    load: bool = False
    """Add the load generator process."""
    var_dir: Path = BASE_DIR / "var"
    """Runtime files: PostgreSQL data, tokens, agent state, Redis, logs, the generated Procfile."""

    @property
    def web_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def router_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.router_port}"

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}"


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def launcher_tokens(var_dir: Path, environ: dict[str, str]) -> dict[str, str]:
    """The agent and service tokens and the KV link secret (``TOKEN_NAMES``): from the environment, else
    created once in ``<var>/launcher_tokens.json``.

    The file is created with mode 0600; tokens are 32 URL-safe random bytes (``secrets.token_urlsafe``).

    Raises:
        ValueError: the file exists but is not a JSON object of strings (delete it to regenerate).
    """
    path = Path(var_dir) / "launcher_tokens.json"
    stored: dict[str, str] = {}
    if path.exists():
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict) or not all(isinstance(v, str) for v in stored.values()):
            raise ValueError(f"{path} is not a JSON object of strings; delete it to create new tokens")
    missing = [name for name in TOKEN_NAMES if not stored.get(name)]
    if missing:
        stored.update({name: secrets.token_urlsafe(32) for name in missing})
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(stored, fh)
    return {name: environ.get(name) or stored[name] for name in TOKEN_NAMES}


def worker_threads(cpu_count: int | None) -> int:
    """Torch threads per model worker: a quarter of the cores, at least 1 (the demo runs 2-4 workers)."""
    return max(1, (cpu_count or 1) // 4)


def child_env(config: LaunchConfig, environ: dict[str, str], *, redis_url: str, database_url: str,
              tokens: dict[str, str], cpu_count: int | None = None) -> dict[str, str]:
    """The environment of every child process (``environ`` plus the launcher's values).

    Values already in ``environ`` win, except ``REDIS_URL`` and ``DATABASE_URL`` (the launcher decided
    them) and ``FERRY_VAR_DIR`` (made absolute).

    Raises:
        ValueError: ``FERRY_WORKER_ENV`` is not a JSON object.
    """
    threads = str(worker_threads(cpu_count if cpu_count is not None else os.cpu_count()))
    defaults = {
        "DEBUG": "1",
        "FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS": str(DEMO_REMOTE_PREFILL_THRESHOLD_TOKENS),
        "FERRY_WORKER_ENV": json.dumps({"TORCH_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}),
        "FERRY_WORKER_EXTRA_ARGS": DEMO_WORKER_EXTRA_ARGS,
    }
    env = {**defaults, **environ, **tokens}
    # prefill and decode workers share the per-link KV secret (inference_worker serve: FERRY_KV_LINK_SECRET)
    worker_env = json.loads(env["FERRY_WORKER_ENV"])
    if not isinstance(worker_env, dict):
        raise ValueError('FERRY_WORKER_ENV must be a JSON object, e.g. {"OMP_NUM_THREADS": "1"}')
    worker_env.setdefault("FERRY_KV_LINK_SECRET", tokens["FERRY_KV_LINK_SECRET"])
    env["FERRY_WORKER_ENV"] = json.dumps(worker_env)
    env.update(REDIS_URL=redis_url, DATABASE_URL=database_url, FERRY_VAR_DIR=str(Path(config.var_dir).resolve()), PYTHONUNBUFFERED="1",
               DJANGO_SETTINGS_MODULE="controlplane.settings")
    return env


ROUTER_FIXED_OPTIONS = ("--host", "--port", "--routing-table", "--no-auth", "--service-token")


def router_extra_args(text: str) -> list[str]:
    """``FERRY_ROUTER_EXTRA_ARGS`` split like a shell would (e.g. ``--breaker-window 10 --no-breaker``) and checked
    with the router's own parser, so a typo stops ``make run`` with argparse's message instead of a router that
    exits after start. The options ``make run`` sets itself (:data:`ROUTER_FIXED_OPTIONS`) are refused.

    Raises:
        ValueError: unbalanced quotes, a fixed option, or an option the router's parser refuses (its message).
    """
    import argparse
    import contextlib
    import io

    from inference_worker.cli import router as router_cli

    args = shlex.split(text)
    fixed = sorted({a.split("=", 1)[0] for a in args} & set(ROUTER_FIXED_OPTIONS))
    if fixed:
        raise ValueError(f"FERRY_ROUTER_EXTRA_ARGS may not set {', '.join(fixed)}: make run sets them")
    parser = argparse.ArgumentParser(prog="inference_worker router", exit_on_error=False)
    router_cli.add_arguments(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(["--port", "1", "--routing-table", "x", *args])
    except (argparse.ArgumentError, SystemExit) as exc:
        detail = str(exc) if isinstance(exc, argparse.ArgumentError) else stderr.getvalue().strip().splitlines()[-1]
        raise ValueError(f"FERRY_ROUTER_EXTRA_ARGS: {detail}") from None
    return args


def procfile(config: LaunchConfig, *, python: str, tokenizer_dir: Path | None = None,
             router_args: str = "") -> str:
    """The Procfile text (``name: command`` lines) for ``config``; ``python`` is the interpreter to use;
    ``router_args``: extra router options (``FERRY_ROUTER_EXTRA_ARGS``, checked by :func:`router_extra_args`,
    which raises ``ValueError``)."""
    py = shlex.quote(python)
    extra_router = "".join(f" {shlex.quote(a)}" for a in router_extra_args(router_args))
    var = Path(config.var_dir).resolve()
    log_dir = shlex.quote(str(var / "log"))
    routing_table = f"{config.web_url}/api/v1/routing-table/"
    celery = f"{py} -m celery -A controlplane"
    lines = {
        "web": f"exec {py} -m controlplane.web --host {shlex.quote(config.host)} --port {config.port} "
               f"--access-log {log_dir}/web-access.log",
        "worker": f"exec {celery} worker -Q operations,default -n ops@%h --concurrency 3 "
                  "--without-gossip --without-mingle --loglevel INFO",
        "ticks": f"exec {celery} worker -Q reconcile -n ticks@%h --pool solo --without-gossip --without-mingle "
                 "--loglevel INFO",
        "beat": f"exec {celery} beat --loglevel INFO",
        "telemetry": f"exec {py} manage.py telemetry",
        "agent": f"exec {py} -m inference_worker agent --port {config.agent_port} "
                 f"--state-dir {shlex.quote(str(var / 'agent'))} --log-level warning",
        "router": f"exec {py} -m inference_worker router --host {shlex.quote(config.host)} --port {config.router_port} "
                  f"--routing-table {routing_table} --log-level warning"
                  + (f" --tokenizer {shlex.quote(str(tokenizer_dir))}" if tokenizer_dir else "") + extra_router,
    }
    if config.load:
        out = shlex.quote(str(var / "load" / "serve_load.json"))
        ready = shlex.quote(str(var / "ready"))  # written by the launcher once every worker is ready
        lines["load"] = (
            f"until [ -e {ready} ]; do sleep 2; done; n=0; while :; do n=$((n+1)); "
            f"{py} bench/serve_load.py --base-url {config.router_url} --model gemma-3-270m "
            f"--concurrency 2 --sessions {LOAD_SESSIONS} --turns {LOAD_TURNS} --system-tokens 200 --user-tokens 50:150 "
            f"--turn-output-tokens 16 --request-rate 0.5 --seed $n --session-prefix round$n- "
            f"--timeout-s 120 --out {out}; sleep 1; done"
        )
    return "".join(f"{name}: {command}\n" for name, command in lines.items())
