"""The operator flow on real workers, in the browser (Playwright + Debian's Chromium, headless).

Stack: daphne (ASGI app), the telemetry poller process (``manage.py telemetry``, direct scrape), a
Celery worker (pool Actions, rollout steps), the local agent running real Gemma 3 270M workers
(``python -m inference_worker serve --model gemma-3-270m``), and a reconcile + rollout tick loop
standing in for beat. One test, because the flow shares processes and the transactional database is
flushed between tests; never more than two model workers at a time.

1. Open a pool with a live worker under multi-turn load (``bench/workloads.py`` sessions, answers appended):
   chart data grows (5 points within 10 s), tokens/s shows generation, the prefix-cache hit-rate chart shows
   hits; the operator flushes the KV cache from the page (a ``pool.flush_kv_cache`` Action that succeeds and logs
   the blocks the worker cleared).
2. Scale the pool 1 -> 2 -> 1 from the page: the replica count follows ("2 / 2", then "1 / 1").
3. Create a canary rollout on the rollout list page, start it on its page, see its step advance
   (set_weight applied -> the pause step is current); abort asks for confirmation (dismiss: nothing
   happens; accept: aborted).
"""

from __future__ import annotations

import io
import json
import re
import threading
import time

import httpx
import pytest
from django.core.management import call_command
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from apps.dashboard.tests.live_stack import (
    ARTIFACTS,
    CHROMIUM,
    CeleryWorkerProcess,
    ReconcileLoop,
    purge_celery_queues,
    signed_in,
    telemetry_poller,
    wait_for_page,
)
from apps.fleet.models import Replica
from apps.fleet.services import cluster_create, pool_create
from apps.operations.models import Action
from apps.operations.pools import pool_scale
from apps.telemetry.models import AlertRule
from bench.workloads import MultiTurnConfig, MultiTurnWorkload
from inference_worker.tests.support.agent import AgentProcess, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium: apt-get install -y chromium"),
]
READY_TIMEOUT_S = 300
KV_LINK_SECRET = "live-dashboard-kv-link-secret-0123456789"
WORKER_ENV = json.dumps({"TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "FERRY_KV_LINK_SECRET": KV_LINK_SECRET})
SESSIONS = MultiTurnWorkload.from_config(MultiTurnConfig(num_sessions=2, num_turns=3, num_system_tokens=48,
                                                         user_tokens=(8, 16), max_tokens=8))


class Load(threading.Thread):
    """Multi-turn sessions against one worker, one request at a time, over and over until stopped (gives the
    charts traffic; every turn's prompt extends the previous turn's prompt and answer, so the cache hits)."""

    def __init__(self, url: str, worker_token: str):
        super().__init__(name="load", daemon=True)
        self.url, self.stop_event, self.done = url, threading.Event(), 0
        self.headers = {"Authorization": f"Bearer {worker_token}"}  # the worker requires its pool's token

    def run(self) -> None:
        with httpx.Client(timeout=60, headers=self.headers) as client:
            while not self.stop_event.is_set():
                for session in SESSIONS.sessions:
                    answers: list[list[int]] = []
                    for turn in session.turns:
                        if self.stop_event.is_set():
                            return
                        body = {"model": "gemma-3-270m", "prompt": session.prompt(answers), "temperature": 0,
                                "max_tokens": turn.max_tokens, "ignore_eos": True, "return_token_ids": True}
                        try:
                            response = client.post(self.url + "/v1/completions", json=body)
                        except httpx.HTTPError:
                            time.sleep(0.5)
                            break
                        if response.status_code != 200:
                            break
                        self.done += 1
                        answers.append(response.json()["choices"][0]["token_ids"])

    def stop(self) -> None:
        self.stop_event.set()
        self.join(90)


@pytest.fixture
def stack(tmp_path, settings, server):
    """Agent, Celery worker, telemetry poller and the reconcile/rollout tick loop around ``server``."""
    agent = AgentProcess(tmp_path / "agent").launch()  # agent, Celery worker and poller start together
    env = {"FERRY_AGENT_TOKEN": agent.token, "FERRY_WORKER_ENV": WORKER_ENV,
           "FERRY_WORKER_EXTRA_ARGS": "--max-num-seqs 2", "FERRY_ACTION_READY_TIMEOUT_S": "280",
           "FERRY_KV_LINK_SECRET": KV_LINK_SECRET}  # the Celery worker signs the KV cache flush with it
    settings.FERRY_AGENT_TOKEN = agent.token  # reconcile runs in this process
    settings.FERRY_WORKER_ENV = WORKER_ENV
    settings.FERRY_WORKER_EXTRA_ARGS = "--max-num-seqs 2"
    purge_celery_queues()
    celery = CeleryWorkerProcess(tmp_path, env).launch()
    poller = telemetry_poller(tmp_path, interval_s=1.0, window_s=10.0)
    try:
        agent.wait_healthy()
        celery.wait_ready()
    except BaseException:
        poller.stop()
        celery.stop()
        agent.terminate()
        raise
    loop = ReconcileLoop(interval_s=2.0)
    loop.start()
    yield {"agent": agent, "celery": celery, "poller": poller, "loop": loop}
    loop.stop()
    poller.stop()
    celery.stop(timeout_s=60)
    agent.terminate()


def ready_replicas(pool_id: int) -> int:
    return Replica.objects.filter(pool_id=pool_id, ready=True, alive=True).count()


def trace(chart: str, index: int = 0, axis: str = "y") -> str:
    """A JS expression: the ``axis`` values of trace ``index`` of chart ``chart`` ([] before it is drawn)."""
    return f"((document.getElementById('chart-{chart}')?.data || [])[{index}]?.{axis} || [])"


def replica_count_is(page, text: str, timeout_s: float) -> None:
    page.wait_for_function(f"document.getElementById('replica-count').textContent === {text!r}",
                           timeout=timeout_s * 1000, polling=500)


def test_operator_watches_live_charts_scales_the_pool_and_starts_a_canary(
        stack, server, browser, operator_session, make_model_version):
    version = make_model_version("v1", name="gemma-3-270m")
    cluster = cluster_create(name="here", kind="local", agent_url=stack["agent"].base_url, datacenter="dc1")
    pool = pool_create(name="local-a", cluster=cluster, role="colocated", model_version=version, replicas=0,
                       drain_timeout_s=30)
    call_command("dashboard_cpu_alert_rules", "--pool", str(pool.pk), stdout=io.StringIO())
    assert AlertRule.objects.get(pool=pool, name="ttft-p99-high").threshold == 10.0
    pool_scale(pool=pool, replicas=1)
    assert wait_for(lambda: ready_replicas(pool.pk) == 1, READY_TIMEOUT_S), stack["celery"].log()[-3000:]
    pool.refresh_from_db()
    load = Load(Replica.objects.get(pool=pool).endpoint, pool.worker_token)
    load.start()
    try:
        context, page, guard = signed_in(browser, server, "olga")
        page.goto(f"{server.base_url}/pools/{pool.pk}/")
        # The busy ratio of the live worker (CPU: labelled as the engine's busy ratio, not GPU utilization).
        page.wait_for_function(f"{trace('utilization')}.some(v => v !== null)", timeout=60_000, polling=500)
        title = page.evaluate("document.getElementById('chart-utilization').layout.title.text")
        assert title.startswith("Engine busy ratio (CPU workers") and "not GPU utilization" in title
        before = page.evaluate(f"{trace('utilization', axis='x')}.length")
        try:  # at least 5 new points within 10 s (one poll per second, on a loaded 2-core machine): done at the 5th
            page.wait_for_function(f"{trace('utilization', axis='x')}.length >= {before + 5}", timeout=10_000,
                                   polling=500)
        except PlaywrightTimeoutError:
            pass  # the assertion below says how many came
        after = page.evaluate(f"{trace('utilization', axis='x')}.length")
        assert after - before >= 5, (before, after)
        try:  # generation tokens/s of the load, charted
            page.wait_for_function(f"{trace('tokens', 1)}.some(v => v !== null && v > 0)", timeout=90_000,
                                   polling=500)
        except Exception as exc:
            charts = page.evaluate("Object.fromEntries(['tokens', 'running', 'ttft'].map(c => [c, "
                                   "document.getElementById('chart-' + c).data.map(t => t.y.slice(-5))]))")
            raise AssertionError(f"no generation tokens/s charted; completions done {load.done}; charts {charts}; "
                                 f"stats {page.evaluate('window.ferryStats')}; poller log "
                                 f"{stack['poller'].log()[-2000:]}") from exc
        # Multi-turn load hits the prefix cache: the hit-rate chart (tokens) gets data above 0.
        page.wait_for_function(f"{trace('prefix-cache-hit-rate')}.some(v => v !== null && v > 0)", timeout=90_000,
                               polling=500)
    finally:
        load.stop()
    page.screenshot(path=str(ARTIFACTS / "live-pool-charts.png"), full_page=True, timeout=120_000)
    assert load.done > 0

    # Flush the KV cache from the page (confirmed): the Action succeeds and logs the blocks the worker cleared.
    page.once("dialog", lambda d: d.accept())
    page.click("#flush-kv-cache", no_wait_after=True)
    wait_for_page(page, "document.getElementById('flush-result').textContent.includes('pool.flush_kv_cache')",
                           timeout=30_000, polling=500)
    page.wait_for_selector("#actions tr.status-succeeded td:text('pool.flush_kv_cache')", timeout=120_000)
    flush = Action.objects.get(pool=pool, kind="pool.flush_kv_cache")
    cleared = [int(m.group(1)) for line in flush.log
               if (m := re.fullmatch(r"flushed .+: (\d+) blocks cleared", line["message"]))]
    assert len(cleared) == 1 and cleared[0] > 0, flush.log

    # Scale from the page: 1 -> 2, then back to 1; the count shows ready / desired.
    replica_count_is(page, "1 / 1", 30)
    for target, text in ((2, "2 / 2"), (1, "1 / 1")):
        page.fill("#scale-replicas", str(target))
        page.click("#scale-submit", no_wait_after=True)  # the form posts with fetch: no navigation to wait for
        wait_for_page(page, "document.getElementById('scale-result').textContent.includes('pool.scale')",
                               timeout=120_000, polling=500)
        replica_count_is(page, text, READY_TIMEOUT_S)
        page.screenshot(path=str(ARTIFACTS / f"live-pool-scaled-to-{target}.png"), full_page=True, timeout=120_000)
    page.wait_for_selector("#actions tr.status-succeeded")

    # A canary from the rollout pages: create (list page), start, step advances, abort with confirmation.
    make_model_version("v2", name="gemma-3-270m")
    page.goto(f"{server.base_url}/rollouts/")
    page.fill("#rc-name", "gemma-v2-canary")
    page.select_option("#rc-pools", [str(pool.pk)])
    page.select_option("#rc-target", label="gemma-3-270m:v2")
    page.click("#rc-mode-json")  # the steps as JSON: the editor's "Advanced (JSON)" view
    page.fill("#rc-steps", '[{"set_weight": 50}, {"pause": {}}]')
    page.click("#rc-submit")
    page.wait_for_url(re.compile(r".*/rollouts/[0-9]+/$"))
    page.click("#rollout-controls button[data-verb=start]", no_wait_after=True)
    wait_for_page(page, "document.getElementById('rollout-state').textContent === 'progressing'",
                           timeout=120_000, polling=500)
    page.wait_for_function(  # set_weight 50 applied (canary ready): the pause step is the current one
        "document.querySelector('#steps li.current')?.textContent === 'pause until resumed'",
        timeout=READY_TIMEOUT_S * 1000, polling=500)
    assert page.inner_text("#rollout-position") == "step 2 of 2"
    assert page.locator("#steps li.done").all_inner_texts() == ["set weight 50%"]
    page.wait_for_function(f"{trace('canary-weight')}.includes(50)", timeout=30_000)  # the 50% step, charted
    page.screenshot(path=str(ARTIFACTS / "live-rollout-step-advanced.png"), full_page=True, timeout=120_000)

    state = page.inner_text("#rollout-state")  # at a pause step without seconds: paused until resumed
    assert state == "paused"
    dialogs = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.click("#rollout-controls button[data-verb=abort]", no_wait_after=True)
    page.wait_for_timeout(3_000)
    assert page.inner_text("#rollout-state") == state  # dismissed: nothing sent
    page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.click("#rollout-controls button[data-verb=abort]", no_wait_after=True)
    wait_for_page(page, "document.getElementById('rollout-state').textContent === 'aborted'",
                           timeout=120_000, polling=500)
    assert [m.startswith("Abort rollout gemma-v2-canary?") for m in dialogs] == [True, True]
    page.wait_for_selector("#events td:text('rollout.abort')")
    page.screenshot(path=str(ARTIFACTS / "live-rollout-aborted.png"), full_page=True, timeout=120_000)
    assert guard.remote == []
    context.close()
