"""Dashboard fixtures: signed-in sessions per role, a clean telemetry keyspace in the real Redis
(``REDIS_URL``: run with a Redis db of your own), and a worker metrics exporter over HTTP."""

from __future__ import annotations

import pytest
from django.test import Client
from prometheus_client import start_http_server

from apps.accounts.services import user_create_with_role
from apps.dashboard.tests.live_stack import ARTIFACTS, Daphne, launch_chromium
from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.history import SignalHistory
from apps.telemetry.testing import served_router_metrics
from inference_worker.metrics import WorkerMetrics


@pytest.fixture
def telemetry_keys():
    """The default telemetry keyspace (the one consumers read) emptied before and after the test."""
    history = SignalHistory()
    history.clear()
    yield history
    history.clear()


def _session(role: str, username: str):
    created = user_create_with_role(username=username, role=role, password="correct-horse-battery-9")
    client = Client()
    client.force_login(created.user)
    client.username, client.password = username, created.password
    client.session_key = client.cookies["sessionid"].value
    return client


@pytest.fixture
def operator_session(db):
    return _session("operator", "olga")


@pytest.fixture
def viewer_session(db):
    return _session("viewer", "victor")


@pytest.fixture
def exporter(pool):
    """A worker's real metrics registry (``inference_worker.metrics``) served on a loopback port,
    as replica ``r0`` of ``pool``'s stable track."""
    metrics = WorkerMetrics({"pool": pool.name, "track": "stable", "replica": "r0", "role": "decode"})
    metrics.set_ready(True)
    metrics.set_engine_state(num_waiting=2, num_running=1, kv_cache_usage=0.25, busy_ratio=0.5)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    yield metrics, ReplicaEndpoint(str(pool.pk), "stable", "r0", f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


@pytest.fixture
def router_exporter():
    """A router's real metrics registry served on a loopback port: ``(RouterMetrics, RouterEndpoint)``."""
    with served_router_metrics() as exporter:
        yield exporter


@pytest.fixture(scope="module")
def daphne(django_db_setup, tmp_path_factory):
    """One daphne (the ASGI app, :class:`~apps.dashboard.tests.live_stack.Daphne`) for a test module, on the test
    database: one costs 15 s to start and 3.5 s to stop on the shared 2-core machine at load 20 (and a Chromium 11 s
    and 2 s), once per module instead of once per test. It keeps no state of its own between tests: each test's rows are committed and flushed (``transaction=True``) and the telemetry
    keyspace is the test's (``server``)."""
    server = Daphne(tmp_path_factory.mktemp("daphne")).start()
    yield server
    server.stop()


@pytest.fixture
def server(daphne, telemetry_keys):
    """The module's daphne, with the telemetry keyspace emptied before and after the test."""
    return daphne


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for a test module (each test opens its own browser context in ``signed_in``)."""
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread for as long as it runs, i.e. the whole module; the
    # tests' own ORM calls are plain synchronous code, so Django's async-context guard is lifted meanwhile.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            yield browser
            browser.close()


@pytest.fixture
def browser(chromium):
    """The module's Chromium."""
    return chromium
