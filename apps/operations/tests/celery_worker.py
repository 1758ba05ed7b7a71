"""A real Celery worker process for tests: ``celery -A controlplane worker`` on the test database.

The worker reads the same broker as the test process (``settings.CELERY_BROKER_URL``) and the
test database (pytest-django's ``test_<name>`` on Postgres; tests using it need
``django_db(transaction=True)`` so their rows are committed and visible to the worker). Pool
``solo``: the task runs in the worker's main process, so SIGKILL stops it mid-action.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from django.conf import settings
from django.db import connection

from inference_worker.tests.support.worker import REPO_ROOT

QUEUES = ("operations", "reconcile")


def database_url() -> str:
    """URL of the database the test process uses now (the test database)."""
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def purge_queues() -> None:
    """Drop messages left in Ferry's queues by earlier runs (only these queues)."""
    from controlplane.celery import app

    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for queue in QUEUES:
            try:
                channel.queue_purge(queue)
            except Exception:  # noqa: BLE001 - a queue that never existed
                pass


class CeleryWorker:
    """``celery worker`` as a child process with extra environment (e.g. a short action lease)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def start(self, timeout_s: float = 90.0) -> CeleryWorker:
        """:meth:`launch`, then :meth:`wait_ready`."""
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> CeleryWorker:
        """Start the process without waiting (a test then starts its other processes while this one imports)."""
        name = f"ferry-test-{uuid.uuid4().hex[:8]}"
        self.log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, "DATABASE_URL": database_url(), "REDIS_URL": settings.CELERY_BROKER_URL,
               "DJANGO_SETTINGS_MODULE": "controlplane.settings", "TORCH_NUM_THREADS": "1",
               "OMP_NUM_THREADS": "1", **self.extra_env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-Q", ",".join(QUEUES),
                 "--pool", "solo", "-n", f"{name}@%h", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-l", "INFO"],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 90.0) -> CeleryWorker:
        """Wait for the worker's `` ready.`` log line.

        Raises:
            RuntimeError: the worker exited or was not ready in ``timeout_s`` (the message carries its log's end).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"celery worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if " ready." in self.log():
                return self
            time.sleep(0.3)
        raise RuntimeError(f"celery worker not ready within {timeout_s}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no cleanup, no acknowledgement of the running task."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (warm shutdown), then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
