"""Issue 25, acceptance 2: release v2 on the demo fleet and roll it back from the browser, by visible controls only.

The stack is ``make run LOAD=1`` itself: ``python -m apps.setup.run --load`` (the launcher: ``ferry_setup`` loads the
demo fleet, then web, Celery worker and ticks, beat, telemetry, agent, router and the load generator, which sends
multi-turn sessions through the router from the moment the launcher reports ready) on this test's database and
Redis. Real Gemma 3 270M workers: v1 (float32) on the demo's prefill and decode pools, v2 (bfloat16) on the canary.

The operator signs in on the fleet page and from there only clicks links, buttons and the editor's fields: no URL is
typed and no JSON is written. Along the way the test asserts the states, weights and replica counts the pages show and
the database holds:

1. fleet: both pools on v1, 1 / 1 replicas, requests flowing;
2. rollout editor: steps "set weight 50%" (the slider) and "pause until resumed"; the preview says stable 1 · canary 1
   per pool; Create -> pending;
3. Start -> the canary step settles: paused at step 2 of 2, each pool stable v1 1 replica at 50% + canary v2 1 replica
   at 50%, both ready; the fleet, pool and link pages under load;
4. Resume -> promoted: each pool one stable track on v2, 1 replica, 100%; the "traffic on the target version" chart
   ends at 100%;
5. Rollback (confirmed) -> the rollback rollout's page: it ends "rolled back" (state ``promoted``: the state machine's
   end of a rollback rollout, ``apps.rollouts.transitions``), each pool one stable track on v1 at 100%, and its
   traffic-on-v1 chart never shows a value between 0 and 100 (the finalize split between two tracks of the same
   version is not a partial rollback).

Screenshots (``test-artifacts/dashboard/release-rollback/``): ``01-fleet-v1-under-load.png``,
``02-rollout-editor.png``, ``03-rollout-canary-50.png``, ``04-fleet-canary.png``, ``05-pool-decode-canary.png``,
``06-link-under-load.png``, ``07-rollout-promoted.png``, ``08-rollout-rolled-back.png``,
``09-fleet-v1-after-rollback.png``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from apps.dashboard.tests.live_stack import (
    ARTIFACTS,
    CHROMIUM,
    current_database_url,
    signed_in,
    wait_for_page,
)
from apps.fleet.models import Pool, Replica
from apps.rollouts.models import RolloutPlan
from inference_worker.tests.support.worker import REPO_ROOT, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # make run's start and five worker moves; 15 to 20 minutes on a loaded 2-core machine
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium: apt-get install -y chromium"),
]

SCREENS = ARTIFACTS / "release-rollback"
READY_TIMEOUT_S = 420
"""make run to "Ferry is ready" (two Gemma workers on a loaded 2-core machine)."""
MOVE_TIMEOUT_S = 420
"""One rollout move that starts model workers (a canary, or the stable tracks taking a new version)."""
STOP_TIMEOUT_S = 120


class MakeRunLoad:
    """``python -m apps.setup.run --load`` in its own session on this test's database and Redis (``base_url``: its
    web); ``stop`` is one Ctrl-C (SIGINT to the process group), then SIGKILL after :data:`STOP_TIMEOUT_S`."""

    def __init__(self, var_dir: Path, log_path: Path):
        self.ports = {"web": free_port(), "router": free_port(), "agent": free_port()}
        self.base_url = f"http://127.0.0.1:{self.ports['web']}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items()
               if k not in ("FERRY_AGENT_TOKEN", "FERRY_SERVICE_TOKEN", "FERRY_CLIENT_API_KEY")}
        env.update(DATABASE_URL=current_database_url(), REDIS_URL=settings.REDIS_URL, FERRY_VAR_DIR=str(var_dir),
                   PYTHONUNBUFFERED="1", FERRY_WEB_WORKERS="1", DJANGO_SETTINGS_MODULE="controlplane.settings")
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "apps.setup.run", "--load", "--port", str(self.ports["web"]),
                 "--router-port", str(self.ports["router"]), "--agent-port", str(self.ports["agent"])],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "Ferry is ready" in self.log():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(1)
        raise AssertionError(f"make run LOAD=1 not ready within {timeout_s} s:\n{self.log()[-5000:]}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def make_run(tmp_path, transactional_db):
    stack = MakeRunLoad(tmp_path / "var", tmp_path / "make-run.log")
    try:
        stack.wait_ready(READY_TIMEOUT_S)
        yield stack
    finally:
        stack.stop()


def tracks() -> dict[str, list[tuple[str, str, int, int]]]:
    """Each pool's desired tracks as ``(name, version, replicas, weight %)``, by name."""
    return {p.name: sorted((t.name, t.model_version.version, t.replicas, t.weight) for t in p.tracks.all())
            for p in Pool.objects.prefetch_related("tracks__model_version").order_by("name")}


def ready_by_track() -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for pool, track in Replica.objects.filter(ready=True, alive=True).values_list("pool__name", "track"):
        out.setdefault(pool, {}).setdefault(track, 0)
        out[pool][track] += 1
    return out


def table(page, selector: str) -> list[list[str]]:
    return page.evaluate(f"Array.from(document.querySelectorAll({selector!r}), r => Array.from(r.cells, "
                         "c => c.textContent.trim()))")


MISSED_SCREENSHOTS: list[str] = []


def shot(page, name: str) -> None:
    """A screenshot of the (tall) viewport into :data:`SCREENS`. Not ``full_page``: that resizes the viewport, and
    every responsive Plotly chart of a live page redraws, which on a loaded 2-core machine took longer than the
    timeout (the pool page). A screenshot that times out is listed and the flow goes on; the test fails at its end."""
    try:
        page.screenshot(path=str(SCREENS / name), timeout=90_000)
    except Exception as exc:  # playwright's TimeoutError: recorded, asserted after the flow
        MISSED_SCREENSHOTS.append(f"{name}: {str(exc).splitlines()[0]}")


def nav(page, label: str) -> None:
    # a busy live page (the pool page's charts at load 30+) answered a click only after 30 s: 2 minutes here
    page.click(f"header nav a:has-text('{label}')", timeout=120_000)
    page.wait_for_selector("main h1", state="attached", timeout=120_000)


def weight_values(page) -> list[list[float]]:
    return page.evaluate("document.getElementById('chart-canary-weight').data.map(t => t.y.slice())")


def rollout_page_ready(page) -> None:
    """The rollout page's script has run (its steps are drawn): its buttons answer clicks from now on (the state and
    the buttons are in the HTML before plotly.js, which is large, and the page's script have loaded)."""
    page.wait_for_selector("#steps li", state="attached", timeout=60_000)


def state_is(page, state: str, timeout_s: float) -> None:
    page.wait_for_function(f"document.getElementById('rollout-state').dataset.state === {state!r}",
                           timeout=timeout_s * 1000, polling=1000)


def event_times_newest_first(page) -> bool:
    stamps = page.evaluate("Array.from(document.querySelectorAll('#events tbody tr'), r => Number(r.dataset.at))")
    return bool(stamps) and all(a >= b for a, b in zip(stamps, stamps[1:], strict=False))


def test_an_operator_releases_v2_and_rolls_it_back_from_the_fleet_page_by_visible_controls_under_load(
        make_run, browser):
    SCREENS.mkdir(parents=True, exist_ok=True)
    prefill, decode = Pool.objects.get(name="prefill"), Pool.objects.get(name="decode")
    assert tracks() == {"decode": [("stable", "v1", 1, 100)], "prefill": [("stable", "v1", 1, 100)]}
    context, page, guard = signed_in(browser, make_run, "operator")  # the fleet page
    page.set_viewport_size({"width": 1400, "height": 2200})  # a tall window: the screenshots show whole pages
    MISSED_SCREENSHOTS.clear()
    try:
        _flow(page, make_run, prefill, decode)
    except Exception as exc:
        shot(page, "failed.png")
        plans = list(RolloutPlan.objects.order_by("pk").values_list("name", "state", "phase", "message"))
        raise AssertionError(f"{exc}\nrollouts: {plans}\ntracks: {tracks()}\nready: {ready_by_track()}\n"
                             f"make run log tail:\n{make_run.log()[-6000:]}") from exc
    finally:
        context.close()
    assert guard.remote == []
    assert MISSED_SCREENSHOTS == []


def _flow(page, make_run, prefill: Pool, decode: Pool) -> None:
    # 1. The fleet under load: both pools on v1, one replica each, requests through the router.
    page.wait_for_selector("#ws-status.ws-live")
    page.wait_for_function("Array.from(document.querySelectorAll('#datacenters tr[data-pool-id] td:nth-child(6)'))"
                           ".some(td => parseFloat(td.textContent) > 0)", timeout=180_000, polling=1000)
    rows = {r[0]: r[1:4] for r in table(page, "#datacenters tr[data-pool-id]")}
    assert rows == {"prefill": ["prefill", "gemma-3-270m:v1", "1 / 1"], "decode": ["decode", "gemma-3-270m:v1", "1 / 1"]}
    shot(page, "01-fleet-v1-under-load.png")

    # 2. The rollout editor: set weight 50% (slider), pause until resumed; no JSON.
    nav(page, "Rollouts")
    page.wait_for_selector("#rc-step-list li")
    assert page.locator("#rc-json").is_hidden()
    page.fill("#rc-name", "release-v2")
    page.select_option("#rc-pools", label=["dc-decode/decode (decode)", "dc-prefill/prefill (prefill)"])
    assert page.evaluate("document.getElementById('rc-target').selectedOptions[0].textContent") == "gemma-3-270m:v2"
    assert page.evaluate("document.getElementById('rc-router').selectedOptions[0].textContent").startswith(
        "demo-router (dc-decode, ")
    while page.locator("#rc-step-list .step-remove").count():
        page.click("#rc-step-list li:first-child .step-remove")
    page.click("#rc-add-weight")
    page.fill("#rc-step-list li[data-index='0'] .step-weight-slider", "50")
    page.click("#rc-add-pause")
    page.select_option("#rc-step-list li[data-index='1'] .step-pause-kind", "resume")
    page.wait_for_function("document.querySelectorAll('#rc-preview-table tbody tr').length >= 2 && "
                           "document.querySelector('#rc-preview-table tbody tr:nth-child(2)').textContent"
                           ".includes('50%')")
    preview = table(page, "#rc-preview-table tbody tr")
    assert preview[1] == ["1", "set weight 50%", "50%", "stable 1 · canary 1", "stable 1 · canary 1"], preview
    shot(page, "02-rollout-editor.png")
    page.click("#rc-submit")
    rollout_page_ready(page)
    state_is(page, "pending", 30)
    plan = RolloutPlan.objects.get(name="release-v2")
    assert (plan.steps, plan.gates, plan.max_surge) == ([{"set_weight": 50}, {"pause": {}}], [], 1)
    page.wait_for_selector("#gates-empty:not([hidden])")  # no gates: an empty state, not an empty chart
    assert page.locator("#chart-gates").is_hidden()

    # 3. Start: the canary comes up, the 50% step settles and the pause (until resumed) is current.
    page.click("#rollout-controls button[data-verb=start]")
    page.wait_for_function("document.querySelector('#steps li.current')?.textContent === 'pause until resumed'",
                           timeout=MOVE_TIMEOUT_S * 1000, polling=1000)
    state_is(page, "paused", 30)
    assert page.inner_text("#rollout-position") == "step 2 of 2"
    canary = [("canary", "v2", 1, 50), ("stable", "v1", 1, 50)]
    assert tracks() == {"decode": canary, "prefill": canary}
    assert ready_by_track() == {"decode": {"canary": 1, "stable": 1}, "prefill": {"canary": 1, "stable": 1}}
    wait_for_page(page, "document.getElementById('chart-canary-weight').data.every(t => t.y[t.y.length - 1] "
                           "=== 50)", timeout=30_000)
    dashes = page.evaluate("document.getElementById('chart-canary-weight').data.map(t => [t.name, t.line.dash])")
    assert dashes == [["prefill (prefill)", "dot"], ["decode (decode)", "solid"]]  # distinguishable when equal
    shot(page, "03-rollout-canary-50.png")

    nav(page, "Fleet")
    page.wait_for_selector("#ws-status.ws-live")
    shot(page, "04-fleet-canary.png")
    page.click("#datacenters tr[data-pool-id] a:text-is('decode')")
    page.wait_for_function("document.querySelectorAll('#replicas tbody tr').length === 2", timeout=60_000)
    replicas = sorted((r[1], r[2], r[3]) for r in table(page, "#replicas tbody tr"))
    assert replicas == [("canary", "v2", "yes"), ("stable", "v1", "yes")]
    page.wait_for_selector("#actions td:text-is('pool.track_set')", state="attached", timeout=60_000)  # the rollout's track changes are listed
    shot(page, "05-pool-decode-canary.png")
    nav(page, "Fleet")
    page.click("#links tr:has(td:first-child:text-is('dc-prefill')) a:text-is('link page')")
    page.wait_for_selector("#link-bandwidth", state="attached")
    assert page.inner_text("#link-bandwidth") == "10.0 Gbit/s"
    shot(page, "06-link-under-load.png")

    # 4. Back to the rollout by its link; Resume: 100% on v2, then the stable tracks take v2 and it is promoted.
    nav(page, "Rollouts")
    page.click("#rollouts a:text-is('release-v2')")
    rollout_page_ready(page)
    page.click("#rollout-controls button[data-verb=resume]")
    state_is(page, "promoted", MOVE_TIMEOUT_S)
    assert page.inner_text("#rollout-state") == "promoted"
    assert page.inner_text("#rollout-position") == "all 2 steps done"
    assert tracks() == {"decode": [("stable", "v2", 1, 100)], "prefill": [("stable", "v2", 1, 100)]}
    assert set(Pool.objects.values_list("model_version__version", flat=True)) == {"v2"}
    wait_for_page(page, "document.getElementById('chart-canary-weight').data.every(t => t.y[t.y.length - 1] "
                           "=== 100)", timeout=30_000)
    assert event_times_newest_first(page)
    shot(page, "07-rollout-promoted.png")

    # 5. Rollback (confirmed): the new rollout's page; it ends rolled back, every pool on v1 again.
    dialogs: list[str] = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.click("#rollout-controls button[data-verb=rollback]")
    page.wait_for_selector("#rollback-of", state="attached", timeout=60_000)
    rollout_page_ready(page)
    assert dialogs == ["Roll back rollout release-v2? A new rollout moves the pools back to the version they ran "
                       "before."]
    back = RolloutPlan.objects.get(rollback_of__name="release-v2")
    state_is(page, "promoted", MOVE_TIMEOUT_S * 2)
    assert page.inner_text("#rollout-state") == "rolled back"
    assert page.inner_text("#rollout-message") == (
        f"Rolled back: every pool runs gemma-3-270m:v1 again (rollback of rollout #{back.rollback_of_id}).")
    assert tracks() == {"decode": [("stable", "v1", 1, 100)], "prefill": [("stable", "v1", 1, 100)]}
    assert set(Pool.objects.values_list("model_version__version", flat=True)) == {"v1"}
    wait_for_page(page, "document.getElementById('chart-canary-weight').data.every(t => t.y[t.y.length - 1] "
                           "=== 100)", timeout=30_000)
    assert {v for trace in weight_values(page) for v in trace} <= {0, 100}  # never "through 50%"
    assert event_times_newest_first(page)
    shot(page, "08-rollout-rolled-back.png")

    nav(page, "Fleet")
    page.wait_for_function("Array.from(document.querySelectorAll('#datacenters tr[data-pool-id] td:nth-child(3)'))"
                           ".every(td => td.textContent === 'gemma-3-270m:v1')", timeout=30_000)
    shot(page, "09-fleet-v1-after-rollback.png")
