"""A real ``python -m inference_worker router`` process for tests and benches (started, awaited, stopped), and
:func:`send_and_hold`: a request whose client can hang up mid-way (for disconnect tests of routers and workers).

Used by the router tests with real workers, ``bench/routing.py`` and the control plane's rollout
end-to-end tests (which add their own metric readers on top).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from inference_worker.tests.support.agent import wait_for
from inference_worker.tests.support.worker import REPO_ROOT, free_port


class RouterProcess:
    """A router on a free loopback port, reading ``routing_table`` (a file path or a control-plane URL).

    Args:
        routing_table: ``--routing-table`` value.
        *args: further router options (``--policy``, ``--service-token``, ``--table-interval`` ...).
        log_path: file for the router's output (stdout and stderr); None: inherited.
        ready_timeout_s: seconds to wait for ``/ready`` to report a routing table.
        port: the router's port (None: a free one).
        wait: wait for ``/ready`` here (:meth:`wait_ready`); False: return once the process is launched, so
            a test starts its other processes meanwhile, and call :meth:`wait_ready` before using it.

    Raises:
        RuntimeError: the router did not report a routing table within ``ready_timeout_s`` (the message
            carries the end of its log when there is one).
    """

    def __init__(self, routing_table: str | Path, *args: str, log_path: Path | None = None,
                 ready_timeout_s: float = 60.0, port: int | None = None, wait: bool = True) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "inference_worker", "router", "--port", str(self.port),
                   "--routing-table", str(routing_table), "--log-level", "warning", *args]
        if "--api-keys" not in args:
            command.append("--no-auth")  # a test router without keys says so (the router refuses to guess)
        if log_path is None:
            self.proc = subprocess.Popen(command, cwd=REPO_ROOT)
        else:
            with open(log_path, "wb") as log:
                self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.ready_timeout_s = ready_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> RouterProcess:
        """Poll ``/ready`` until it reports a routing table; stops the router and raises RuntimeError after
        ``ready_timeout_s``."""
        if not wait_for(lambda: self.ready_version() is not None, self.ready_timeout_s, 0.1):
            self.stop()
            tail = self.log_path.read_text()[-3000:] if self.log_path is not None else ""
            raise RuntimeError(f"router not ready within {self.ready_timeout_s} s:\n{tail}")
        return self

    def ready_version(self) -> int | None:
        """The routing-table version ``/ready`` reports, or None while the router is not ready."""
        try:
            response = httpx.get(self.url + "/ready", timeout=2)
            return response.json().get("routing_table_version") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self) -> None:
        """SIGTERM (the router drains), then SIGKILL after 30 s."""
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def send_and_hold(base_url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """POST ``body`` (JSON) to ``base_url + path`` on a raw socket and return the socket, unread and open: the
    caller hangs up with ``close()``, which is how a client that leaves mid-request looks to the server."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    raw = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json",
                                                  "Content-Length": str(len(raw)), **(headers or {})}.items())
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + raw)
    return sock
