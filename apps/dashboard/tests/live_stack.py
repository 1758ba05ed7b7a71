"""The dashboard's serving side for browser tests: the ASGI app under daphne and the telemetry poller
as child processes on the test database, a reconcile loop, and a Playwright Chromium launcher.

Children get ``DATABASE_URL`` of pytest-django's test database (tests need
``django_db(transaction=True)`` so their rows are committed) and the test's ``REDIS_URL``.
Daphne runs with ``DEBUG=1``: plain HTTP on loopback and static files (plotly.js included, through
``apps.dashboard.finders``) served by WhiteNoise from the finders, as ``make run`` serves them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import connection, connections

from inference_worker.server.testing import REPO_ROOT, free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
ARTIFACTS = REPO_ROOT / "test-artifacts" / "dashboard"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}


def current_database_url() -> str:
    """URL of the database this test process uses now (pytest-django's test database on Postgres)."""
    s = connection.settings_dict
    if connection.vendor != "postgresql":
        raise RuntimeError("child processes need a server database (Postgres), not " + connection.vendor)
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": current_database_url(), "REDIS_URL": settings.REDIS_URL,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings", "OMP_NUM_THREADS": "1", **extra}


def is_loopback(url: str) -> bool:
    """Whether ``url`` points at this host (data: and blob: URLs never leave the page)."""
    parts = urlsplit(url)
    if parts.scheme in ("data", "blob", "about"):
        return True
    return parts.hostname in LOOPBACK_HOSTS or (parts.hostname or "").startswith("127.")


class ChildProcess:
    """A child process logging to a file; ``stop`` sends SIGTERM, then SIGKILL after ``timeout_s``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name, self.argv, self.env = name, argv, env
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ChildProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Daphne(ChildProcess):
    """``daphne controlplane.asgi:application`` on a free loopback port."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        super().__init__("daphne", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                                    "controlplane.asgi:application"], child_env(DEBUG="1"), log_dir)

    def start(self, timeout_s: float = 60.0) -> Daphne:
        super().start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daphne exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"daphne not serving within {timeout_s}s:\n{self.log()[-3000:]}")


def telemetry_poller(log_dir: Path, *, interval_s: float = 1.0, window_s: float = 10.0) -> ChildProcess:
    """``manage.py telemetry`` (the real poller process: direct scrape of the observed replicas)."""
    return ChildProcess("telemetry", [sys.executable, "manage.py", "telemetry", "--interval", str(interval_s),
                                      "--window", str(window_s)], child_env(), log_dir).start()


class ReconcileLoop(threading.Thread):
    """Runs ``apps.operations.reconcile.reconcile_all`` every ``interval_s`` (what beat does), so observed
    ``Replica`` rows (endpoints, readiness) follow the backend."""

    def __init__(self, interval_s: float = 2.0):
        super().__init__(name="reconcile-loop", daemon=True)
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        from apps.operations.reconcile import reconcile_all

        try:
            while not self.stop_event.wait(self.interval_s):
                try:
                    reconcile_all()
                except Exception as exc:  # recorded for the test's failure message, the loop keeps going
                    self.errors.append(repr(exc))
        finally:
            connections.close_all()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)


def launch_chromium(playwright):
    """Debian's Chromium, headless, with the flags that keep it off the network on its own."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)


class RequestGuard:
    """Records every request and websocket of a browser context; requests to a non-loopback host are
    aborted and listed in ``remote`` (the page must not load anything from a remote host)."""

    def __init__(self, context):
        self.seen: list[str] = []
        self.remote: list[str] = []
        context.route("**/*", self._route)

    def _route(self, route) -> None:
        url = route.request.url
        self.seen.append(url)
        if is_loopback(url):
            route.continue_()
        else:
            self.remote.append(url)
            route.abort()

    def watch(self, page) -> None:
        def on_websocket(ws) -> None:
            self.seen.append(ws.url)
            if not is_loopback(ws.url):
                self.remote.append(ws.url)

        page.on("websocket", on_websocket)
