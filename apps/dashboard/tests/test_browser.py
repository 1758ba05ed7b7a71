"""Browser tests: Playwright with Debian's Chromium (headless) against the ASGI app served by daphne.

1. Every page loads only from loopback (request interception; plotly.js from the plotly package), a
   viewer sees the data and no controls, and the page's stream resyncs after a sequence gap.
2. (slow) An operator watches a pool of real Gemma 3 270M workers: chart data grows over 10 s; scaling
   from the page changes the replica count (Celery worker + local agent + reconcile + telemetry poller).
3. (slow) An operator starts a canary from the rollout page and sees its step advance (needs the
   rollout verbs of the rollouts API).

Screenshots go to ``test-artifacts/dashboard/``. Chromium: ``apt-get install -y chromium`` (never
``playwright install``); without ``/usr/bin/chromium`` these tests are skipped.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import PBKDF2PasswordHasher

from apps.dashboard.tests.live_stack import (
    ARTIFACTS,
    CHROMIUM,
    Daphne,
    RequestGuard,
    launch_chromium,
)
from apps.fleet.services import cluster_link_create
from apps.operations.models import Action
from apps.rollouts.services import rollout_plan_create
from apps.telemetry.broadcast import pool_group, telemetry_broadcast

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium: apt-get install -y chromium"),
]
PASSWORD = "correct-horse-battery-9"  # conftest's sessions use it
PAGE_TIMEOUT_MS = 30_000


@pytest.fixture
def server(tmp_path, telemetry_keys):
    daphne = Daphne(tmp_path).start()
    yield daphne
    daphne.stop()


@pytest.fixture
def browser(monkeypatch):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the test's own ORM calls are plain
    # synchronous code, so Django's async-context guard is lifted for this test only.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = launch_chromium(playwright)
        yield chromium
        chromium.close()


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
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "login-failed.png"))
        raise AssertionError(f"sign-in failed at {page.url}:\n{page.content()[:2000]}\n{server.log()[-3000:]}")
    return context, page, guard


def chart_points(page, chart: str) -> int:
    return page.evaluate(f"document.getElementById('chart-{chart}').data[0].x.length")


def publish(pool_id: int, at: float, waiting: float, history) -> dict:
    """One pool record, broadcast and stored exactly as the poller does it (on another thread: Playwright's
    sync API runs an event loop on this one, where ``async_to_sync`` refuses to run)."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(_publish, pool_id, at, waiting, history).result(timeout=30)


def _publish(pool_id: int, at: float, waiting: float, history) -> dict:
    record = {"pool_id": pool_id, "at": at, "window_s": 10.0, "source": "scrape", "tracks": {},
              "signals": {"num_requests_waiting": waiting, "engine_busy_ratio": 0.25, "ready_replicas": 1.0}}
    message = telemetry_broadcast(pool_group(pool_id), "telemetry.signals", record, history=history)
    history.append(f"pool:{pool_id}", at, message)
    return message


def test_pages_load_only_from_loopback_viewer_has_no_controls_and_gaps_resync(
        server, browser, pool, make_pool, make_cluster, make_model_version, operator_session, viewer_session,
        telemetry_keys):
    prefill = make_pool("prefill", role="prefill")
    cluster_link_create(source=pool.cluster, destination=make_cluster("dc-b"), bandwidth_gbps=10.0, rtt_ms=3.0)
    plan = rollout_plan_create(name="to-v2", pools=[pool, prefill], target_model_version=make_model_version("v2"),
                               strategy="canary", steps=[{"set_weight": 10}, {"pause": {}}],
                               gates=[{"signal": "error_rate", "threshold": 0.01, "comparison": "<", "window_s": 30}])
    Action.objects.create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), target_repr=str(pool),
                          pool=pool, params={"replicas": 3}, status=Action.Status.FAILED, error="backend unreachable",
                          retryable=True)
    now = time.time()
    for i in range(5):
        publish(pool.pk, now - 5 + i, float(i), telemetry_keys)
    pages = {"fleet": "/", "pool": f"/pools/{pool.pk}/", "rollouts": "/rollouts/", "rollout": f"/rollouts/{plan.pk}/",
             "model-versions": "/model-versions/"}

    context, page, guard = signed_in(browser, server, "olga")
    for name, url in pages.items():
        page.goto(server.base_url + url)
        page.wait_for_selector("#ws-status.ws-live" if name in ("fleet", "pool", "rollout") else "main h1")
        page.screenshot(path=str(ARTIFACTS / f"operator-{name}.png"), full_page=True)
        if name == "pool":
            assert page.evaluate("typeof Plotly") == "object"  # served from the plotly package, offline
            page.wait_for_function("document.getElementById('chart-queue-depth').data[0].x.length === 5")
            assert page.locator("#scale-form").count() == 1
            page.wait_for_selector("#actions button.retry")
            # A lost message (seq taken, never delivered) -> the page asks for a snapshot and catches up.
            telemetry_keys.next_seq(pool_group(pool.pk))
            publish(pool.pk, time.time(), 9.0, telemetry_keys)
            page.wait_for_function("window.ferryStats.resyncs === 1 && window.ferryStats.gaps === 1")
            page.wait_for_function("document.getElementById('chart-queue-depth').data[0].x.length === 6")
            assert page.evaluate("document.getElementById('chart-queue-depth').data[0].y.slice(-1)[0]") == 9.0
            publish(pool.pk, time.time(), 10.0, telemetry_keys)  # the next message applies without a resync
            page.wait_for_function("document.getElementById('chart-queue-depth').data[0].x.length === 7")
            assert page.evaluate("window.ferryStats.resyncs") == 1
        if name == "rollout":
            page.wait_for_selector("#steps li.current")
            assert page.locator("#rollout-controls button[data-verb=abort]").count() == 1
            assert page.inner_text("#gates tbody").split("\t")[0] == "error_rate"
    assert any(u.endswith("/static/dashboard/vendor/plotly.min.js") for u in guard.seen)
    assert any(u.startswith("ws://127.0.0.1") for u in guard.seen)
    assert guard.remote == []
    context.close()

    context, page, guard = signed_in(browser, server, "victor")
    for name, url in pages.items():
        page.goto(server.base_url + url)
        page.wait_for_selector("main h1")
        if name == "pool":
            page.wait_for_selector("#actions tbody tr")  # the viewer sees the failed Action ...
            assert page.inner_text("#actions tbody").count("backend unreachable") == 1
        if name == "rollout":
            page.wait_for_selector("#steps li.current")
        page.screenshot(path=str(ARTIFACTS / f"viewer-{name}.png"), full_page=True)
        # ... and no controls at all.
        assert page.locator("#scale-form, #rollout-controls, #rollout-create, button.retry, button.cancel").count() == 0
    assert guard.remote == []
    context.close()


def test_a_remote_script_is_caught_by_the_request_guard(server, browser, operator_session):
    """The guard itself: a request to a non-loopback host is aborted and reported."""
    context, page, guard = signed_in(browser, server, "olga")
    page.evaluate("fetch('https://cdn.example.com/plotly.min.js').catch(() => null)")
    page.wait_for_timeout(500)
    assert guard.remote == ["https://cdn.example.com/plotly.min.js"]
    context.close()


class Load(threading.Thread):
    """Short completions against one worker, one at a time, until stopped (gives the charts traffic)."""

    def __init__(self, url: str):
        super().__init__(name="load", daemon=True)
        self.url, self.stop_event, self.done = url, threading.Event(), 0

    def run(self) -> None:
        body = {"model": "gemma-3-270m", "prompt": "The ferry crossed the river and", "max_tokens": 8,
                "temperature": 0}
        with httpx.Client(timeout=60) as client:
            while not self.stop_event.is_set():
                try:
                    if client.post(self.url + "/v1/completions", json=body).status_code == 200:
                        self.done += 1
                except httpx.HTTPError:
                    time.sleep(0.5)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(90)
