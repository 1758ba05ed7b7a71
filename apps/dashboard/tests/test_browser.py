"""Browser tests: Playwright with Debian's Chromium (headless) against the ASGI app served by daphne.

Every page loads only from loopback (request interception; plotly.js from the plotly package), a
viewer sees the data and no controls, and the page's stream resyncs after a sequence gap. The live
worker flow (charts grow, scale, canary) is in ``test_live_workers.py``.

Screenshots go to ``test-artifacts/dashboard/``. Chromium: ``apt-get install -y chromium`` (never
``playwright install``); without ``/usr/bin/chromium`` these tests are skipped.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from apps.dashboard.tests.live_stack import ARTIFACTS, CHROMIUM, signed_in, wait_for_page
from apps.dashboard.views import DEFAULT_ROLLOUT_STEPS
from apps.fleet.services import cluster_link_create
from apps.operations.models import Action
from apps.rollouts.models import RolloutPlan
from apps.rollouts.services import rollout_plan_create
from apps.telemetry.broadcast import pool_group, telemetry_broadcast

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium: apt-get install -y chromium"),
]


# A Plotly date-axis range value (a Date as the page set it, or Plotly's local "YYYY-MM-DD HH:MM:SS.sss") in Unix s.
TO_SECONDS = "(v => (v instanceof Date ? v : new Date(String(v).replace(' ', 'T'))).getTime() / 1000)"


def publish(pool_id: int, at: float, waiting: float, history) -> dict:
    """One pool record, broadcast and stored exactly as the poller does it (on another thread: Playwright's
    sync API runs an event loop on this one, where ``async_to_sync`` refuses to run)."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(_publish, pool_id, at, waiting, history).result(timeout=30)


def _publish(pool_id: int, at: float, waiting: float, history) -> dict:
    record = {"pool_id": pool_id, "at": at, "window_s": 10.0, "source": "scrape", "tracks": {},
              "signals": {"num_requests_waiting": waiting, "engine_busy_ratio": 0.25, "ready_replicas": 1.0,
                          "router_local_prefill_per_s": waiting / 2, "router_remote_prefill_per_s": 0.25,
                          "router_local_prefill_fallback_per_s": None, "router_ejected_replicas": 1.0}}
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
            wait_for_page(page, "document.getElementById('chart-queue-depth').data[0].x.length === 5")
            assert page.locator("#scale-form").count() == 1
            page.wait_for_selector("#actions button.retry")
            # A lost message (seq taken, never delivered) -> the page asks for a snapshot and catches up.
            telemetry_keys.next_seq(pool_group(pool.pk))
            publish(pool.pk, time.time(), 9.0, telemetry_keys)
            page.wait_for_function("window.ferryStats.resyncs === 1 && window.ferryStats.gaps === 1")
            wait_for_page(page, "document.getElementById('chart-queue-depth').data[0].x.length === 6")
            assert page.evaluate("document.getElementById('chart-queue-depth').data[0].y.slice(-1)[0]") == 9.0
            publish(pool.pk, time.time(), 10.0, telemetry_keys)  # the next message applies without a resync
            wait_for_page(page, "document.getElementById('chart-queue-depth').data[0].x.length === 7")
            assert page.evaluate("window.ferryStats.resyncs") == 1
            # Router decisions: local (fallback included) vs remote prefill, the fallback alone "no data".
            router = page.evaluate("Array.from(document.getElementById('chart-router').data, "
                                   "t => [t.name, t.y.length, t.y[t.y.length - 1]])")
            assert router == [["local prefill", 7, 5.0], ["remote prefill", 7, 0.25],
                              ["fallback (local)", 7, None]]
            assert page.evaluate("document.getElementById('chart-ejections').data[0].y") == [1.0] * 7
            # An empty chart: the last five minutes up to now and "no data yet" (Plotly's default is the year 2000);
            # a chart with data: the axis around its records.
            ranges = page.evaluate("Object.fromEntries(['ttft', 'queue-depth'].map(c => { const d = document"
                                   ".getElementById('chart-' + c); return [c, [d.layout.xaxis.range.map(v => "
                                   f"{TO_SECONDS}(v)), "
                                   "d.layout.annotations.map(a => a.text)]]; }))")
            (ttft_start, ttft_end), ttft_notes = ranges["ttft"]
            assert (round(ttft_end - ttft_start, 3), ttft_notes) == (300.0, ["no data yet"])
            assert abs(ttft_end - time.time()) < 60
            (start, end), notes = ranges["queue-depth"]
            assert notes == [] and start <= now - 5 and end >= now - 1 and end - start < 120
        if name == "rollout":
            # not started: no step in effect yet, the first one is next; steps are numbered from 1
            page.wait_for_selector("#steps li.next")
            assert page.locator("#steps li.next").all_inner_texts() == ["set weight 10%"]
            assert page.locator("#steps li.current").count() == 0
            assert page.inner_text("#rollout-position") == "before step 1 of 2"
            assert page.evaluate("document.getElementById('steps').start") == 1  # the list numbers steps from 1
            assert page.locator("#rollout-controls button[data-verb=abort]").count() == 1
            page.wait_for_selector("#gates tr[data-gate-index='0']")
            assert page.inner_text("#gates tr[data-gate-index='0'] td:nth-child(2)") == "error_rate"
            assert page.inner_text("#gates tr[data-gate-index='0'] .verdict") == "not measured yet"
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
            page.wait_for_selector("#steps li.next")
        page.screenshot(path=str(ARTIFACTS / f"viewer-{name}.png"), full_page=True)
        # ... and no controls at all.
        assert page.locator("#scale-form, #rollout-controls, #rollout-create, button.retry, button.cancel").count() == 0
    assert guard.remote == []
    context.close()


def test_rollout_create_form_defaults_follow_the_pools_and_create_lands_on_the_rollouts_own_url(
        server, browser, pool, make_pool, make_model_version, operator_session):
    prefill = make_pool("prefill", role="prefill")  # both run v1 (the pool fixture's version)
    v2, v3 = make_model_version("v2"), make_model_version("v3")
    make_pool("decode-b", model_version=v3)
    context, page, guard = signed_in(browser, server, "olga")
    page.goto(f"{server.base_url}/rollouts/")
    page.wait_for_selector("#rollout-create")
    assert page.input_value("#rc-target") == str(v2.pk)  # every pool: v1 and v3 are run
    assert json.loads(page.input_value("#rc-steps")) == DEFAULT_ROLLOUT_STEPS
    page.select_option("#rc-pools", [str(pool.pk), str(prefill.pk)])
    assert page.input_value("#rc-target") == str(v3.pk)  # the newest version these two do not run
    page.select_option("#rc-target", str(v2.pk))  # picked by hand: the pool selection no longer moves it
    page.select_option("#rc-pools", [str(pool.pk)])
    assert page.input_value("#rc-target") == str(v2.pk)
    page.select_option("#rc-pools", [str(pool.pk), str(prefill.pk)])
    page.fill("#rc-name", "v2-from-the-page")
    page.click("#rc-submit")
    page.wait_for_selector("#rollout-state")
    plan = RolloutPlan.objects.get(name="v2-from-the-page")
    assert page.url == f"{server.base_url}/rollouts/{plan.pk}/"
    assert (plan.target_model_version_id, plan.steps, sorted(plan.pools.values_list("pk", flat=True))) == (
        v2.pk, DEFAULT_ROLLOUT_STEPS, [pool.pk, prefill.pk])
    page.reload()  # the address is the rollout's own: a reload shows the same rollout
    assert page.inner_text("main h1").startswith("Rollout v2-from-the-page")
    # The weight chart, charted from the first reading: no "no data yet" note, an axis around now.
    wait_for_page(page, "document.getElementById('chart-canary-weight').data[0].x.length >= 1")
    wait_for_page(page, "document.getElementById('chart-canary-weight').layout.annotations.length === 0")
    end = page.evaluate(f"{TO_SECONDS}(document.getElementById('chart-canary-weight').layout.xaxis.range[1])")
    assert abs(end - time.time()) < 60
    page.screenshot(path=str(ARTIFACTS / "operator-rollout-created.png"), full_page=True)
    assert guard.remote == []
    context.close()


def test_a_remote_script_is_caught_by_the_request_guard(server, browser, operator_session):
    """The guard itself: a request to a non-loopback host is aborted and reported."""
    context, page, guard = signed_in(browser, server, "olga")
    page.evaluate("fetch('https://cdn.example.com/plotly.min.js').catch(() => null)")
    page.wait_for_timeout(500)
    assert guard.remote == ["https://cdn.example.com/plotly.min.js"]
    context.close()


def test_finished_rollout_page_charts_its_history_allows_only_its_verbs_and_rollback_opens_the_new_rollout(
        server, browser, make_pool, make_model_version, operator_session):
    """Opened after the fact: the weight chart is the rollout's recorded history, not one flat reading; a promoted
    rollout's Abort is disabled (the server's allowed verbs); Rollback asks first, then the page is the new rollout,
    which links back, and the old one's event log links to it."""
    from apps.rollouts.services import rollout_start
    from apps.rollouts.tests.conftest import drive

    pool = make_pool("chat", role="colocated")
    plan = rollout_plan_create(name="to-v2", pools=[pool], target_model_version=make_model_version("v2"),
                               strategy="canary", steps=[{"set_weight": 25}, {"set_weight": 50}])
    with ThreadPoolExecutor(max_workers=1) as executor:  # off Playwright's event loop thread (see publish)
        executor.submit(lambda: (rollout_start(plan=plan), drive(plan))).result(timeout=120)  # to promoted
    context, page, guard = signed_in(browser, server, "olga")
    page.goto(f"{server.base_url}/rollouts/{plan.pk}/")
    page.wait_for_selector("#steps li")
    assert page.evaluate("document.getElementById('steps').start") == 1  # the list numbers steps from 1
    assert page.inner_text("#rollout-position") == "all 2 steps done"
    chart = "document.getElementById('chart-canary-weight')"
    history = page.evaluate(f"{chart}.data[0].y.slice()")
    # Traffic on v2: created at 0, the steps, 100% after them, and 100% through the finalize (the stable track takes v2
    # and the split between the two v2 tracks is all v2) and after the canary track is removed, then live readings.
    assert history[:4] == [0, 25, 50, 100] and set(history[4:]) <= {100}, history
    # The pool's line keeps its role's style and the legend shows; a plan without gates says so instead of an
    # empty chart; the event log runs newest first, Actions and their log lines alike.
    assert page.evaluate(f"[{chart}.data[0].line.dash, {chart}.layout.showlegend]") == ["dashdot", True]
    assert page.locator("#chart-gates").is_hidden() and page.locator("#gates-empty").is_visible()
    page.wait_for_selector("#events tbody tr.log")
    stamps = page.evaluate("Array.from(document.querySelectorAll('#events tbody tr'), r => Number(r.dataset.at))")
    assert len(stamps) > 10 and stamps == sorted(stamps, reverse=True), stamps
    assert page.inner_text("#rollout-state") == "promoted"
    span = page.evaluate(f"(d => (new Date(d.x[d.x.length - 1]) - new Date(d.x[0])) / 1000)({chart}.data[0])")
    assert span > 0 and page.evaluate(f"{chart}.layout.annotations.length") == 0
    enabled = page.evaluate("Array.from(document.querySelectorAll('#rollout-controls button'), b => [b.dataset.verb, "
                            "!b.disabled])")
    assert enabled == [["start", False], ["pause", False], ["resume", False], ["promote", False], ["abort", False],
                       ["rollback", True]]
    # and a disabled "danger" button looks disabled (it kept its red, enabled look before)
    looks = page.evaluate("['abort', 'rollback'].map(v => { const s = getComputedStyle(document.querySelector("
                          "`#rollout-controls button[data-verb=${v}]`)); return [s.cursor, s.color]; })")
    assert looks[0][0] == "not-allowed" and looks[1][0] == "pointer" and looks[0][1] != looks[1][1]
    dialogs = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.click("#rollout-controls button[data-verb=rollback]")
    page.wait_for_timeout(300)
    assert dialogs == ["Roll back rollout to-v2? A new rollout moves the pools back to the version they ran before."]
    assert RolloutPlan.objects.filter(rollback_of=plan).count() == 0  # dismissed: nothing was asked
    page.once("dialog", lambda d: d.accept())
    page.click("#rollout-controls button[data-verb=rollback]")
    page.wait_for_url(lambda url: url != f"{server.base_url}/rollouts/{plan.pk}/")
    back = RolloutPlan.objects.get(rollback_of=plan)
    assert page.url == f"{server.base_url}/rollouts/{back.pk}/"
    assert page.inner_text("#rollback-of") == f"Rollback of rollout #{plan.pk}"
    # a rollback reads as one: started by the verb, it is "rolling back" (state progressing)
    assert (page.inner_text("#rollout-state"), page.get_attribute("#rollout-state", "data-state")) == (
        "rolling back", "progressing")
    page.goto(f"{server.base_url}/rollouts/{plan.pk}/")
    page.wait_for_selector("#events a.rollout-link")
    assert page.get_attribute("#events a.rollout-link", "href") == f"/rollouts/{back.pk}/"
    assert page.inner_text("#rolled-back-by") == f"Rolled back by rollout #{back.pk}"
    page.screenshot(path=str(ARTIFACTS / "operator-rollout-rolled-back.png"), full_page=True)
    assert guard.remote == []
    context.close()


def test_pool_page_draws_the_slow_requests_waterfall_with_phase_bars_and_labels(
        server, browser, pool, operator_session, telemetry_keys):
    """A stored poll (the collector's join of a router's and a decode worker's ring records) drawn as bars:
    one row per request, slowest on top, one bar per phase in its lane, each labelled with its phase."""
    from apps.telemetry.slow_requests import join_records, slow_requests_store
    from apps.telemetry.tests.test_slow_requests import decode_timeline, router_timeline

    slow = join_records(decode_timeline().as_record(), router_timeline().as_record(), replica="d0")
    fast = {**slow, "request_id": "req-2", "duration_ms": 40.0, "phases": slow["phases"][:2]}
    now = time.time()
    slow_requests_store(telemetry_keys, pool_id=pool.pk, at_s=now, rows=[slow, fast])
    # A long history (15 minutes at one poll per second, every chart's signals set; the page's snapshot takes the
    # last 5 minutes): the page must stay light.
    from apps.telemetry.signals import SIGNAL_NAMES

    for i in range(900):
        at = now - 900 + i
        telemetry_keys.append(f"pool:{pool.pk}", at, {"type": "telemetry.signals", "pool_id": pool.pk, "at": at,
                                                      "window_s": 10, "signals": dict.fromkeys(SIGNAL_NAMES, 0.5),
                                                      "tracks": {}})
    context, page, guard = signed_in(browser, server, "olga")
    page.goto(f"{server.base_url}/pools/{pool.pk}/")
    page.wait_for_selector("#slow-requests .main-svg")
    page.wait_for_function("document.querySelectorAll('#charts .main-svg').length > 0 && "
                           "document.querySelector('#charts .chart').data[0].x.length >= 290")
    # Each marker is an SVG node redrawn on every update: 900-point traces with one marker per point grew the
    # page to ~77,000 nodes and pinned the tab's CPU (a new user's report). Markers are capped per trace.
    markers = page.evaluate("Math.max(...[...document.querySelectorAll('#charts .chart')]"
                            ".map(c => c.querySelectorAll('.scatterlayer .point').length))")
    nodes = page.evaluate("document.getElementsByTagName('*').length")
    assert markers <= 60 * 3 and nodes < 8000, (markers, nodes)
    traces = page.evaluate("document.getElementById('slow-requests').data.map(t => "
                           "({name: t.name, y: t.y, text: t.text, base: t.base, x: t.x}))")
    assert [t["name"] for t in traces] == ["router", "prefill", "transfer", "decode"]
    assert traces[0] == {"name": "router", "y": ["req-1 · 100 ms"] * 2 + ["req-2 · 40 ms"] * 2,
                         "text": ["router.admit", "router.route"] * 2, "base": [0, 1, 0, 1], "x": [1, 2, 1, 2]}
    assert traces[1] == {"name": "prefill", "y": ["req-1 · 100 ms"] * 2, "text": ["prefill.compute", "prefill.queue"],
                         "base": [14, 9], "x": [40, 5]}
    assert traces[2] == {"name": "transfer", "y": ["req-1 · 100 ms"], "text": ["kv.transfer"], "base": [54], "x": [10]}
    assert traces[3]["text"] == ["worker.parse", "decode.queue", "decode"] and traces[3]["base"] == [4, 64, 65]
    ticks = page.locator("#slow-requests .ytick text").all_text_contents()
    assert ticks == ["req-2 · 40 ms", "req-1 · 100 ms"]  # slowest on top (Plotly draws categories bottom-up)
    labels = set(page.locator("#slow-requests .bartext").all_text_contents())
    assert {"prefill.compute", "kv.transfer", "decode"} <= labels
    assert page.locator("#slow-requests .bars path").count() == 10
    page.screenshot(path=str(ARTIFACTS / "pool-slow-requests.png"), full_page=True)
    assert guard.remote == []
    context.close()
