"""ProcessManager: the local agent's process table, the way a kubelet owns pods.

* Only ``python -m inference_worker serve|router ...`` is ever run. The agent appends
  ``--host 127.0.0.1 --port <free port>`` (and ``--replica <name>`` for serve); requests may not set those, and the
  environment may only carry allow-listed variables (``FERRY_*``, thread counts, device masks), so
  no request can run an arbitrary command or inject code through ``PYTHONPATH``/``LD_PRELOAD``.
* Workers get only the secrets they need: the agent's own environment is inherited without the
  control plane's credentials (:data:`NOT_INHERITED`: the agent and service tokens, Django's secret key, the
  database and Redis URLs, stray worker tokens); what a worker needs (the KV link secret, its pool's worker token)
  comes in the request's ``env``.
* Each worker runs in its own session (so its own process group): a Ctrl-C aimed at the agent's
  terminal does not reach the workers and skip their drain; stop sends SIGTERM to the group,
  waits up to the drain timeout and then SIGKILLs the group.
* Readiness is ``GET /ready`` every ``ready_poll_s``: an answer other than 200 (loading, draining) makes a worker
  unready at once; a probe that gets no answer within ``probe_timeout_s`` does so only after
  :data:`READY_FAILURE_THRESHOLD` in a row (Kubernetes' ``failureThreshold``), so one slow answer from a busy
  worker does not take the only replica of a track out of the routing table (chaos matrix: 503 "no decode
  replica left" on a loaded host while nothing was stopped).
* stdout/stderr go to ``<state_dir>/logs/<name>.log`` (appended across restarts).
* A dead worker stays in the table with ``alive: false``, its exit code, when it was seen dead
  (``exited_at``) and its termination message; the agent never restarts it on its own: reconcile
  in the control plane decides (``restart``, with backoff). Like a kubelet's
  ``terminationMessagePath``, each worker gets ``FERRY_TERMINATION_MESSAGE_PATH`` =
  ``<state_dir>/logs/<name>.termination`` (emptied at every start) for its last words (a worker
  whose model fails to load writes the error there and exits non-zero).
* Re-adoption: the table is persisted after every change. A new agent reads it and keeps a
  record as alive only if its pid still runs the exact recorded command line
  (``/proc/<pid>/cmdline``), which protects against pid reuse. Adopted workers are not the new
  agent's children, so their exit code is unknown (``None``) once they die.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from inference_worker.agent.state import (
    AgentState,
    InvalidRequest,
    ProcessExists,
    ProcessNotFound,
    ProcessRecord,
    StateStore,
)

logger = logging.getLogger(__name__)

ROLES = ("serve", "router")
RESERVED_FLAGS = ("--port", "--host", "--replica")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")
_ENV_KEY = re.compile(
    r"^(FERRY_[A-Z0-9_]+|OMP_NUM_THREADS|MKL_NUM_THREADS|TORCH_NUM_THREADS|CUDA_VISIBLE_DEVICES"
    r"|HF_HUB_OFFLINE|TOKENIZERS_PARALLELISM)$"
)


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(f"name {name!r} must be lowercase letters, digits, '-' or '.', at most 63 characters")
    return name


def validate_args(args: list[str]) -> list[str]:
    """Accept only ``serve ...`` / ``router ...`` argument lists without the agent-owned flags.

    Raises:
        InvalidRequest: naming the offending argument.
    """
    if not args or args[0] not in ROLES:
        raise InvalidRequest(
            f"args must start with one of {', '.join(ROLES)} (the agent only runs "
            f"'python -m inference_worker serve|router ...'), got {args[:1]!r}"
        )
    if len(args) > 200:
        raise InvalidRequest("at most 200 arguments")
    for arg in args:
        if not isinstance(arg, str) or "\x00" in arg or len(arg) > 4096:
            raise InvalidRequest(f"argument {arg!r} is not a plain string")
        if arg.split("=", 1)[0] in RESERVED_FLAGS:
            raise InvalidRequest(f"{arg.split('=', 1)[0]} is set by the agent; remove it from args")
    return list(args)


NOT_INHERITED = frozenset({"FERRY_AGENT_TOKEN", "FERRY_SERVICE_TOKEN", "FERRY_CLIENT_API_KEY", "SECRET_KEY", "FERRY_SECRET_KEY",
                           "DATABASE_URL", "REDIS_URL", "FERRY_POSTGRES_PASSWORD",
                           "FERRY_WORKER_TOKEN", "FERRY_WORKER_TOKEN_PREVIOUS"})
"""Variables of the agent's environment its children never inherit (a request's ``env`` may still set them: a
worker's pool token comes only in its own request, never from whatever the agent's shell held)."""


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without :data:`NOT_INHERITED`: the base environment of every process the agent starts."""
    return {key: value for key, value in environ.items() if key not in NOT_INHERITED}


def validate_env(env: Mapping[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not _ENV_KEY.match(key):
            raise InvalidRequest(
                f"environment variable {key!r} is not allowed: only FERRY_*, OMP/MKL/TORCH_NUM_THREADS, "
                "CUDA_VISIBLE_DEVICES, HF_HUB_OFFLINE and TOKENIZERS_PARALLELISM")
        if not isinstance(value, str) or "\x00" in value:
            raise InvalidRequest(f"environment variable {key!r} must be a plain string")
    return dict(env)


def free_port(exclude: set[int]) -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago and is not in ``exclude``."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in exclude:
            return port
    raise OSError("no free port found")  # pragma: no cover


def read_cmdline(pid: int) -> list[str] | None:
    """The argv of a running, non-zombie ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return [part.decode() for part in raw.split(b"\x00")[:-1]]


def matches_filter(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


READY_FAILURE_THRESHOLD = 3
"""Readiness probes in a row without an answer before a ready worker counts as unready (module docstring)."""


class ProcessManager:
    """Starts, stops, restarts and watches worker processes; thread-safe."""

    def __init__(self, state_dir: Path, *, python: str = sys.executable, cwd: Path | None = None,
                 ready_poll_s: float = 1.0, probe_timeout_s: float = 1.0) -> None:
        self.store = StateStore(state_dir)
        self.log_dir = self.store.state_dir / "logs"
        self.log_dir.mkdir(exist_ok=True)
        self.python = python
        self.cwd = cwd or Path.cwd()
        self.ready_poll_s = ready_poll_s
        self._lock = threading.RLock()
        self._children: dict[str, subprocess.Popen] = {}
        self._closing = threading.Event()
        self._poller: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(probe_timeout_s))
        self._probe_misses: dict[tuple[str, int], int] = {}  # (name, pid) -> readiness probes unanswered in a row
        self.state: AgentState = self.store.load()
        self._readopt()

    # -- lifecycle --------------------------------------------------------------------------------

    def _readopt(self) -> None:
        for record in self.state.processes.values():
            if record.alive and read_cmdline(record.pid) == record.cmdline:
                record.adopted, record.stopping = True, False
                logger.info("re-adopted %s (pid %d, port %d)", record.name, record.pid, record.port)
            elif record.alive:
                record.alive, record.ready, record.stopping = False, False, False
                record.exited_at = time.time()
                record.termination_message = self._termination_message(record.name)
                logger.warning("%s (pid %d) is gone; kept as not alive", record.name, record.pid)
        self.store.save(self.state)

    def start_poller(self) -> None:
        self._poller = threading.Thread(target=self._poll_loop, name="agent-poller", daemon=True)
        self._poller.start()

    def close(self) -> None:
        self._closing.set()
        if self._poller is not None:
            self._poller.join(5)
        self._http.close()

    def _poll_loop(self) -> None:
        while not self._closing.wait(self.ready_poll_s):
            self.poll_once()

    def poll_once(self) -> None:
        """Refresh liveness, exit codes and readiness (GET /ready == 200) of every process."""
        with self._lock:
            records = [r for r in self.state.processes.values() if r.alive]
        changed = False
        for record in records:
            alive, exit_code = self._check_alive(record)
            ready = alive and not record.stopping and self._ready_verdict(record)
            if not alive:
                self._probe_misses.pop((record.name, record.pid), None)
            with self._lock:
                if (record.alive, record.exit_code, record.ready) != (alive, exit_code, ready):
                    if record.alive and not alive:
                        record.exited_at = time.time()
                        record.termination_message = self._termination_message(record.name)
                    record.alive, record.exit_code, record.ready = alive, exit_code, ready
                    changed = True
        if changed:
            with self._lock:
                self.store.save(self.state)

    def _check_alive(self, record: ProcessRecord) -> tuple[bool, int | None]:
        child = self._children.get(record.name)
        if child is not None and child.pid == record.pid:
            code = child.poll()
            return code is None, code
        return read_cmdline(record.pid) == record.cmdline, record.exit_code

    def _termination_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.termination"

    def _termination_message(self, name: str) -> str:
        """What the process wrote to its termination message file (at most 4096 bytes), or ""."""
        try:
            with open(self._termination_path(name), "rb") as fh:
                return fh.read(4096).decode(errors="replace").strip()
        except OSError:
            return ""

    def _probe_ready(self, port: int) -> bool | None:
        """``GET /ready``: True for 200, False for another answer or a refused connection, None for no answer
        within the probe timeout."""
        try:
            return self._http.get(f"http://127.0.0.1:{port}/ready").status_code == 200
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return False

    def _ready_verdict(self, record: ProcessRecord) -> bool:
        """Readiness of a live worker from this probe and the unanswered ones before it (module docstring)."""
        key = (record.name, record.pid)
        probe = self._probe_ready(record.port)
        if probe is not None:
            self._probe_misses.pop(key, None)
            return probe
        misses = self._probe_misses[key] = self._probe_misses.get(key, 0) + 1
        return record.ready and misses < READY_FAILURE_THRESHOLD

    # -- verbs ------------------------------------------------------------------------------------

    def start(self, name: str, args: list[str], env: Mapping[str, str] | None = None,
              labels: Mapping[str, str] | None = None, drain_timeout_s: float = 30.0) -> dict[str, Any]:
        """Start ``python -m inference_worker <args> --host 127.0.0.1 --port P [--replica <name>]``.

        Raises:
            InvalidRequest: bad name, args, env, labels or drain timeout.
            ProcessExists: a process with this name is in the table (alive or dead).
        """
        validate_name(name)
        args = validate_args(args)
        env = validate_env(env or {})
        labels = {str(k): str(v) for k, v in (labels or {}).items()}
        if not 0 < drain_timeout_s <= 3600:
            raise InvalidRequest(f"drain_timeout_s must be in (0, 3600], got {drain_timeout_s}")
        with self._lock:
            if name in self.state.processes:
                raise ProcessExists(f"process {name!r} exists; DELETE it or POST .../restart")
            record = self._spawn(name, args, env, labels, drain_timeout_s, restart_count=0)
            self.state.processes[name] = record
            self.store.save(self.state)
            return record.public()

    def _spawn(self, name: str, args: list[str], env: dict[str, str], labels: dict[str, str],
               drain_timeout_s: float, restart_count: int) -> ProcessRecord:
        port = free_port({r.port for r in self.state.processes.values()})
        cmdline = [self.python, "-m", "inference_worker", *args, "--host", "127.0.0.1", "--port", str(port)]
        if args[0] == "serve":
            cmdline += ["--replica", name]  # the worker's metrics label; the router has no replica name
        log_path = self.log_dir / f"{name}.log"
        termination = self._termination_path(name)
        termination.write_bytes(b"")  # a restarted worker's message is its own, never the previous one's
        with open(log_path, "ab") as log:
            log.write(f"--- ferry agent: starting {name}: {' '.join(cmdline)}\n".encode())
            log.flush()
            child = subprocess.Popen(  # noqa: S603 (argv validated above, no shell)
                cmdline, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**inherited_env(os.environ), "PYTHONUNBUFFERED": "1", **env,
                     "FERRY_TERMINATION_MESSAGE_PATH": str(termination)},
                start_new_session=True,
            )
        self._children[name] = child
        logger.info("started %s: pid %d port %d", name, child.pid, port)
        return ProcessRecord(
            name=name, args=args, env=env, labels=labels, drain_timeout_s=drain_timeout_s, port=port,
            pid=child.pid, cmdline=cmdline, log_path=str(log_path), started_at=time.time(),
            restart_count=restart_count,
        )

    def get(self, name: str) -> dict[str, Any]:
        with self._lock:
            return self._record(name).public()

    def _record(self, name: str) -> ProcessRecord:
        record = self.state.processes.get(name)
        if record is None:
            raise ProcessNotFound(f"no process named {name!r}")
        return record

    def list(self, selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [r.public() for r in sorted(self.state.processes.values(), key=lambda r: r.name)
                    if matches_filter(r.labels, selector or {})]

    def stop(self, name: str, timeout_s: float | None = None) -> dict[str, Any]:
        """SIGTERM the worker's process group, wait for its drain, SIGKILL after the timeout; remove it.

        Returns the final record (``exit_code`` set when known). Raises ProcessNotFound/ProcessExists.
        """
        with self._lock:
            record = self._record(name)
            if record.stopping:
                raise ProcessExists(f"process {name!r} is already being stopped")
            record.stopping, record.ready = True, False
            self.store.save(self.state)
        self._terminate(record, record.drain_timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            self.state.processes.pop(name, None)
            self._children.pop(name, None)
            self.store.save(self.state)
        return record.public()

    def restart(self, name: str) -> dict[str, Any]:
        """Stop (with drain) and start again with the same args, env, labels; restart_count + 1."""
        with self._lock:
            record = self._record(name)
            if record.stopping:
                raise ProcessExists(f"process {name!r} is being stopped")
            record.stopping, record.ready = True, False
        self._terminate(record, record.drain_timeout_s)
        with self._lock:
            new = self._spawn(name, record.args, record.env, record.labels, record.drain_timeout_s,
                              restart_count=record.restart_count + 1)
            self.state.processes[name] = new
            self.store.save(self.state)
            return new.public()

    def _terminate(self, record: ProcessRecord, timeout_s: float) -> None:
        child = self._children.get(record.name)
        alive, code = self._check_alive(record)
        if alive:
            _signal_group(record.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while alive and time.monotonic() < deadline:
                time.sleep(0.05)
                alive, code = self._check_alive(record)
            if alive:
                logger.warning("%s did not exit within %.1fs of SIGTERM: SIGKILL", record.name, timeout_s)
                _signal_group(record.pid, signal.SIGKILL)
                if child is not None:
                    code = child.wait(10)
                else:
                    while self._check_alive(record)[0]:
                        time.sleep(0.05)
        record.alive, record.ready, record.exit_code, record.stopping = False, False, code, False

    def stop_all(self) -> None:
        """Stop every worker concurrently (each with its own drain timeout). Used on agent SIGTERM."""
        names = [n for n, r in list(self.state.processes.items()) if r.alive and not r.stopping]
        threads = [threading.Thread(target=self._stop_quietly, args=(n,)) for n in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _stop_quietly(self, name: str) -> None:
        try:
            self.stop(name)
        except (ProcessNotFound, ProcessExists):
            pass

    def logs(self, name: str, tail: int = 100) -> str:
        """The last ``tail`` lines of the process log (reads at most the last 4 MiB)."""
        if not 1 <= tail <= 100_000:
            raise InvalidRequest(f"tail must be in 1..100000, got {tail}")
        with self._lock:
            path = Path(self._record(name).log_path)
        if not path.exists():
            return ""
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4 * 2**20))
            lines = fh.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-tail:]) + ("\n" if lines else "")

    # -- templates (what a local "Deployment" looks like; kept for scale-from-zero) ---------------

    def put_template(self, name: str, template: dict[str, Any]) -> dict[str, Any]:
        validate_name(name)
        if not isinstance(template.get("labels", {}), dict):
            raise InvalidRequest("template labels must be an object")
        with self._lock:
            self.state.templates[name] = template
            self.store.save(self.state)
        return template

    def get_template(self, name: str) -> dict[str, Any]:
        with self._lock:
            if name not in self.state.templates:
                raise ProcessNotFound(f"no template named {name!r}")
            return self.state.templates[name]

    def list_templates(self, selector: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {n: t for n, t in sorted(self.state.templates.items())
                    if matches_filter(t.get("labels", {}), selector or {})}

    def delete_template(self, name: str) -> None:
        with self._lock:
            if self.state.templates.pop(name, None) is not None:
                self.store.save(self.state)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the worker leads its own session, so its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass
