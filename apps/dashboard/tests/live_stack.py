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
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.db import connection, connections

from inference_worker.tests.support.worker import REPO_ROOT, free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
ARTIFACTS = REPO_ROOT / "test-artifacts" / "dashboard"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}


def current_database_url() -> str:
    """URL of the database this test process uses now (pytest-django's test database on Postgres)."""
    s = connection.settings_dict
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
        """:meth:`launch` (subclasses also wait until the process serves)."""
        return self.launch()

    def launch(self) -> ChildProcess:
        """Start the process without waiting."""
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
        self.launch()
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


class WebServer(Daphne):
    """The production ``web`` process (``python -m controlplane.web``: uvicorn, ``workers`` processes, or the default
    for this machine's cores when None) on a free loopback port; started and probed like :class:`Daphne`."""

    def __init__(self, log_dir: Path, workers: int | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        ChildProcess.__init__(self, "web", [sys.executable, "-m", "controlplane.web", "--host", "127.0.0.1",
                                            "--port", str(self.port),
                                            *(["--workers", str(workers)] if workers else [])],
                              child_env(DEBUG="1"), log_dir)


def telemetry_poller(log_dir: Path, *, interval_s: float = 1.0, window_s: float = 10.0) -> ChildProcess:
    """``manage.py telemetry`` (the real poller process: direct scrape of the observed replicas)."""
    return ChildProcess("telemetry", [sys.executable, "manage.py", "telemetry", "--interval", str(interval_s),
                                      "--window", str(window_s)], child_env(), log_dir).start()


class ReconcileLoop(threading.Thread):
    """What beat does, every ``interval_s``: ``apps.operations.reconcile.reconcile_all`` (observed ``Replica``
    rows follow the backend) and ``apps.rollouts.tasks.rollouts_tick`` (due rollout steps advance)."""

    def __init__(self, interval_s: float = 2.0):
        super().__init__(name="reconcile-loop", daemon=True)
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        from apps.operations.reconcile import reconcile_all
        from apps.rollouts.tasks import rollouts_tick

        try:
            while not self.stop_event.wait(self.interval_s):
                try:
                    reconcile_all()
                    rollouts_tick()
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


CELERY_QUEUES = ("default", "operations", "reconcile")  # pool Actions and rollouts.advance


def purge_celery_queues() -> None:
    """Drop messages earlier runs left in these queues of the test broker (``REDIS_URL``)."""
    from controlplane.celery import app

    with app.connection_for_write() as conn:
        for queue in CELERY_QUEUES:
            try:
                conn.default_channel.queue_purge(queue)
            except Exception:  # a queue that never existed
                pass


class CeleryWorkerProcess(ChildProcess):
    """``celery -A controlplane worker`` (pool solo) on the test database, for Actions and rollout steps."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        name = f"dashboard-test-{os.getpid()}"
        super().__init__("celery", [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-Q",
                                    ",".join(CELERY_QUEUES), "--pool", "solo", "-n", f"{name}@%h", "--without-gossip",
                                    "--without-mingle", "--without-heartbeat", "-l", "INFO"],
                         child_env(**env), log_dir)

    def start(self, timeout_s: float = 90.0) -> CeleryWorkerProcess:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        return self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 90.0) -> CeleryWorkerProcess:
        """Wait for the worker's `` ready.`` log line; RuntimeError when it exited or is not ready in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"celery worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if " ready." in self.log():
                return self
            time.sleep(0.3)
        raise RuntimeError(f"celery worker not ready within {timeout_s}s:\n{self.log()[-3000:]}")


PASSWORD = "correct-horse-battery-9"  # conftest's sessions use it
PAGE_TIMEOUT_MS = 30_000


def signed_in(browser, server, username: str):
    """A new browser context signed in through the login page, with its request guard.

    The test settings hash passwords with MD5 for speed; the server runs the production hashers, so
    the user's password is stored with PBKDF2 (the default) first.
    """
    hasher = PBKDF2PasswordHasher()
    get_user_model().objects.filter(username=username).update(password=hasher.encode(PASSWORD, hasher.salt()))
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    guard = RequestGuard(context)
    page = context.new_page()
    guard.watch(page)
    page.goto(f"{server.base_url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("#sign-in")
    try:
        page.wait_for_url(f"{server.base_url}/")
    except Exception as exc:
        page.screenshot(path=str(ARTIFACTS / "login-failed.png"))
        raise AssertionError(f"sign-in failed at {page.url}:\n{page.content()[:2000]}\n{server.log()[-3000:]}") from exc
    return context, page, guard


def wait_for_page(page, expression: str, **kwargs):
    """``page.wait_for_function(expression)``, where an expression that reads an element or chart the page has not
    built yet (``document.getElementById(…)`` null, a Plotly div without ``data``: a TypeError) counts as not yet
    true instead of failing the wait: Playwright rejects at the predicate's first exception, so a page that builds its
    charts after its stream went live raced every such wait. Other errors still fail at once."""
    return page.wait_for_function(
        f"() => {{ try {{ return ({expression}); }} catch (e) {{ if (e instanceof TypeError) return false; throw e; }} }}",
        **kwargs)
