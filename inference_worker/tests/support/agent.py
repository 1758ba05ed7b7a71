"""Helpers for tests that need a real agent: run ``python -m inference_worker agent`` on a free port.

Used by the agent tests and the local orchestrator backend tests; nothing here is used when serving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from inference_worker.tests.support.worker import REPO_ROOT, free_port

TOKEN = "test-agent-token-0123456789"


class AgentProcess:
    """The agent as a child process; ``state_dir`` survives :meth:`kill` so a new agent can re-adopt."""

    def __init__(self, state_dir: Path, *, port: int | None = None, token: str = TOKEN) -> None:
        self.state_dir = Path(state_dir)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.proc: subprocess.Popen | None = None
        self.log_path = self.state_dir.parent / f"agent-{self.port}.log"

    def start(self, timeout_s: float = 60.0) -> AgentProcess:
        """:meth:`launch`, then :meth:`wait_healthy`."""
        return self.launch().wait_healthy(timeout_s)

    def launch(self) -> AgentProcess:
        """Start the process without waiting (a test then starts its other processes while this one imports)."""
        env = {**os.environ, "FERRY_AGENT_TOKEN": self.token, "TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inference_worker", "agent", "--host", "127.0.0.1", "--port", str(self.port),
                 "--state-dir", str(self.state_dir), "--ready-poll", "0.5"],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_healthy(self, timeout_s: float = 60.0) -> AgentProcess:
        """Poll ``/health`` until 200.

        Raises:
            RuntimeError: the agent exited (the message carries its log's end) or was not healthy in ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"agent not healthy within {timeout_s}s")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=120)

    def terminate(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (the agent drains and stops its workers), wait; returns the exit status."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL the agent only: its workers keep running in their own sessions."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5):
    """Poll ``predicate()`` until it returns a truthy value; returns it, or the last value on timeout."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value
