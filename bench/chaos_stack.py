"""The whole product for ``bench/chaos.py``: embedded PostgreSQL and Redis, ``ferry_setup``, the launcher's
processes under a supervisor that restarts what the bench killed, kill -9 of any of them, RSS of each.

Why a bench supervisor and not a restart-on-exit mode in ``make run``'s launcher: the launcher stopping
everything when one process exits is what an operator of ``make run`` wants (a crash is seen at once, not
hidden by a restart loop), and honcho's ``Manager`` has no restart. The bench also needs what a restart mode
would not give: to know that *it* killed the process (an unexpected exit is a finding, recorded per cell),
the time of the kill and of the restart, and Redis as a target, which the launcher runs outside its
process list. So the supervisor lives here and the launcher stays as it is.

Nothing is copied from the launcher: the commands come from :func:`apps.setup.procfile.procfile`, the
environment from :func:`apps.setup.procfile.child_env`, setup from :func:`apps.setup.run.run_setup`,
leftovers are swept by :func:`apps.setup.run.sweep`, and the servers are the launcher's embedded ones
(:func:`apps.setup.embedded_redis.start_embedded_redis`, :func:`apps.setup.embedded_postgresql.start_embedded_postgres`)
— never the machine's Redis or PostgreSQL: ``REDIS_URL`` and ``DATABASE_URL`` of the caller are ignored.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from honcho.environ import parse_procfile

from apps.setup.embedded_postgresql import start_embedded_postgres
from apps.setup.embedded_redis import EmbeddedRedis, free_tcp_port, redis_reachable, start_embedded_redis
from apps.setup.procfile import (
    BASE_DIR,
    LaunchConfig,
    child_env,
    launcher_tokens,
    procfile,
)
from apps.setup.readiness import ReadinessTarget, readiness_missing
from apps.setup.run import run_setup, sweep

REDIS = "redis"
RESTART_DELAY_S = 1.0
"""Seconds between seeing a supervised process dead and starting it again (a pod restart is not instant)."""
STOP_TIMEOUT_S = 45.0


def free_ports_in(first: int, last: int, *, count: int) -> list[int]:
    """The first ``count`` ports of ``first..last`` that ``127.0.0.1`` can bind now. Raises ``RuntimeError``
    when fewer are free."""
    found = []
    for port in range(first, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"only {len(found)} of {count} ports free in {first}-{last}")


@dataclass
class Supervised:
    """One process of the Procfile: its command, the running ``Popen`` and its history."""

    name: str
    command: str
    process: subprocess.Popen | None = None
    killed_at: float | None = None
    restarts: list[float] = field(default_factory=list)
    unexpected_exits: list[tuple[float, int]] = field(default_factory=list)


class Stack:
    """Start with :meth:`start`, stop with :meth:`stop` (also on error); times are ``time.monotonic()``."""

    def __init__(self, var_dir: Path, *, throwaway: bool = True, port_range: tuple[int, int] | None = None) -> None:
        """``throwaway``: PostgreSQL without fsync, its data removed at :meth:`stop` (the tests' mode; the bench
        kills no database, and a shared machine's disk stays out of the figures). ``port_range``: ``(first,
        last)``, the web, router, agent, Redis and PostgreSQL ports are the first five free ones in it (a shared
        machine's allotted range; the model workers' ports are the agent's, from the kernel); default: any free.

        Raises:
            RuntimeError: fewer than five free ports in ``port_range``.
        """
        self.var_dir = Path(var_dir).resolve()
        self.throwaway = throwaway
        (self.var_dir / "log").mkdir(parents=True, exist_ok=True)
        ports = free_ports_in(*port_range, count=5) if port_range else [free_tcp_port() for _ in range(5)]
        self.config = LaunchConfig(port=ports[0], router_port=ports[1], agent_port=ports[2], var_dir=self.var_dir)
        self.redis_port, self.postgres_port = ports[3], ports[4]
        self.procs: dict[str, Supervised] = {}
        self.redis: EmbeddedRedis | None = None
        self.postgres = None
        self.env: dict[str, str] = {}
        self.summary: dict = {}
        self.client_api_key = ""
        """The client API key the load sends (``make run``'s, in ``<var>/launcher_tokens.json``); set by :meth:`start`."""
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.redis_restarts: list[float] = []
        self._monitor = threading.Thread(target=self._watch, name="chaos-supervisor", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Embedded servers, setup, every Procfile process, then the supervisor thread.

        Raises:
            RuntimeError: setup failed or a server did not come up.
        """
        from inference_worker.registry import model_cache_dir

        self.redis = start_embedded_redis(self.var_dir, port=self.redis_port)
        self.postgres = start_embedded_postgres(self.var_dir / "postgres", throwaway=self.throwaway,
                                                port=self.postgres_port)
        environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
        tokens = launcher_tokens(self.var_dir, environ)
        # make run's client key: setup stores its hash as the control plane's ``make-run`` key, which reaches the
        # router in the routing table (apps.setup.run.client_key_setup_args); the load sends it.
        self.client_api_key = tokens["FERRY_CLIENT_API_KEY"]
        self.env = child_env(self.config, environ, redis_url=self.redis.url, database_url=self.postgres.url,
                             tokens=tokens)
        self.summary = run_setup(self.config, self.env)
        tokenizer_dir = model_cache_dir() / "gemma-3-270m"
        text = procfile(self.config, python=sys.executable,
                        tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None)
        (self.var_dir / "Procfile").write_text(text)
        for name, command in parse_procfile(text).processes.items():
            self.procs[name] = Supervised(name, command)
            self._spawn(self.procs[name])
        self._monitor.start()

    def _spawn(self, proc: Supervised) -> None:
        log = open(self.var_dir / "log" / f"{proc.name}.log", "ab")  # noqa: SIM115 - the child keeps it
        proc.process = subprocess.Popen(["/bin/sh", "-c", proc.command], cwd=BASE_DIR, env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        log.close()

    def _watch(self) -> None:
        while not self.stopping.wait(0.5):
            with self.lock:
                for proc in self.procs.values():
                    code = proc.process.poll() if proc.process else None
                    if code is None:
                        continue
                    now = time.monotonic()
                    if proc.killed_at is None or (proc.restarts and proc.restarts[-1] > proc.killed_at):
                        proc.unexpected_exits.append((now, code))
                    time.sleep(RESTART_DELAY_S)
                    self._spawn(proc)
                    proc.restarts.append(time.monotonic())
                if self.redis is not None and self.redis.process.poll() is not None:
                    time.sleep(RESTART_DELAY_S)
                    self.redis = start_embedded_redis(self.var_dir, port=self.redis.port)
                    self.redis_restarts.append(time.monotonic())

    def stop(self) -> list[str]:
        """SIGTERM every process group, SIGKILL after ``STOP_TIMEOUT_S``, sweep the model workers, stop the
        servers. Returns what had to be killed, in words."""
        self.stopping.set()
        if self._monitor.is_alive():
            self._monitor.join(10)
        pgids = [p.process.pid for p in self.procs.values() if p.process is not None]
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            if proc.process is not None:
                try:
                    proc.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        killed = sweep(pgids, self.var_dir / "agent")
        if self.postgres is not None:
            self.postgres.stop()
        if self.redis is not None:
            self.redis.stop()
        return killed

    # -- faults ----------------------------------------------------------------------------------------------
    def kill(self, target: str) -> tuple[str, int]:
        """kill -9 ``target``: a Procfile name (its whole process group, as a crashed container),
        ``redis``, or ``model:<pool>:<track>`` (one model worker of that pool's track, from the agent's table;
        the agent and reconcile bring it back, not the supervisor). Returns what was killed, in words, and its pid.

        Raises:
            LookupError: nothing to kill under that name now.
        """
        if target == REDIS:
            with self.lock:
                pid = self.redis.process.pid
                os.killpg(pid, signal.SIGKILL)
            return f"redis-server pid {pid}", pid
        if target.startswith("model:"):
            _, pool, track = target.split(":", 2)
            record = next(iter(self.model_workers(pool, track)), None)
            if record is None:
                raise LookupError(f"no running model worker of pool {pool} track {track}")
            os.kill(record.pid, signal.SIGKILL)
            return f"model worker {record.name} pid {record.pid}", record.pid
        with self.lock:
            proc = self.procs.get(target)
            if proc is None or proc.process is None:
                raise LookupError(f"no supervised process {target!r}; have {sorted(self.procs)}")
            proc.killed_at = time.monotonic()
            os.killpg(proc.process.pid, signal.SIGKILL)
            return f"{target} process group {proc.process.pid}", proc.process.pid

    def model_workers(self, pool: str, track: str) -> list:
        """The agent's live process records of ``pool``'s ``track`` (label ``ferry.io/pool``, ``ferry.io/track``)."""
        from apps.orchestrators.base import LABEL_POOL, LABEL_TRACK
        from inference_worker.agent.processes import read_cmdline
        from inference_worker.agent.state import StateStore

        try:
            records = StateStore(self.var_dir / "agent").load().processes.values()
        except (ValueError, FileNotFoundError):
            return []
        return [r for r in records if r.labels.get(LABEL_POOL) == pool
                and r.labels.get(LABEL_TRACK) == track and read_cmdline(r.pid) == r.cmdline]

    def restarted_at(self, target: str, killed_pid: int) -> float | None:
        """When ``target`` (killed as ``killed_pid``) ran again (``time.monotonic()``), or None if not yet: a
        supervised process restarted, Redis answering PING again, or (``model:<pool>:<track>``) a model worker
        of that track other than ``killed_pid`` alive and ready in the agent's table (the time it is seen)."""
        if target == REDIS:
            if self.redis.process.pid != killed_pid and redis_reachable(self.redis.url, timeout_s=0.5):
                return self.redis_restarts[-1]
            return None
        if target.startswith("model:"):
            _, pool, track = target.split(":", 2)
            if any(r.pid != killed_pid and r.ready for r in self.model_workers(pool, track)):
                return time.monotonic()
            return None
        proc = self.procs[target]
        if proc.process is not None and proc.process.pid != killed_pid and proc.process.poll() is None:
            return proc.restarts[-1]
        return None

    def readiness(self, pools: dict[str, int], client) -> list[str]:  # noqa: ANN001 - an httpx.Client
        """What is not ready (``apps.setup.readiness``) for ``pools`` (name -> desired replicas)."""
        target = ReadinessTarget(self.config.web_url, self.config.router_url, self.env["FERRY_SERVICE_TOKEN"], pools)
        return readiness_missing(target, client)

    # -- memory ----------------------------------------------------------------------------------------------
    def rss_bytes(self) -> dict[str, int]:
        """RSS per process, bytes (psutil): each supervised process with its children (Celery's pool
        processes; the agent without its model workers), Redis, PostgreSQL (postmaster and backends) and each
        model worker (with its children) by its agent name, ``model:<name>``."""
        from inference_worker.agent.processes import read_cmdline
        from inference_worker.agent.state import StateStore

        try:
            records = StateStore(self.var_dir / "agent").load().processes.values()
        except (ValueError, FileNotFoundError):
            records = []
        workers = {f"model:{r.name}": r.pid for r in records if read_cmdline(r.pid) == r.cmdline}

        def members(pid: int) -> list[psutil.Process]:
            try:
                root = psutil.Process(pid)
                return [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return []

        worker_trees = {name: members(pid) for name, pid in workers.items()}
        in_workers = {p.pid for tree in worker_trees.values() for p in tree}

        def rss_of(processes: list[psutil.Process], exclude: set[int]) -> int:
            total = 0
            for process in processes:
                if process.pid in exclude:
                    continue
                try:
                    total += process.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            return total

        # the agent is the model workers' parent: its figure leaves them out (each has its own line)
        rss = {name: rss_of(members(p.process.pid), in_workers) for name, p in self.procs.items() if p.process}
        if self.redis is not None:
            rss[REDIS] = rss_of(members(self.redis.process.pid), set())
        postmaster = self.var_dir / "postgres" / "postmaster.pid"
        if postmaster.exists():
            rss["postgres"] = rss_of(members(int(postmaster.read_text().split()[0])), set())
        for name, tree in worker_trees.items():
            rss[name] = rss_of(tree, set())
        return rss
