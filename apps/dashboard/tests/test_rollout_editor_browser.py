"""Browser tests of the rollout editor, a rollout's history and model version registration (Playwright, Debian's
Chromium, the ASGI app under daphne, as ``test_browser.py``). The three tests share one daphne and one Chromium
(conftest's module-scoped ``daphne`` and ``chromium``): each test has its own browser context and its own (flushed)
database rows."""

from __future__ import annotations

import json

import pytest

from apps.dashboard.tests.live_stack import ARTIFACTS, CHROMIUM, signed_in, wait_for_page
from apps.fleet.services import router_create
from apps.rollouts.models import RolloutPlan
from apps.rollouts.services import rollout_plan_delete

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium: apt-get install -y chromium"),
]

EXPECTED_STEPS = [{"set_weight": 20}, {"pause": {}}, {"set_weight": 60}, {"analysis": {"duration_s": 45}},
                  {"pause": {"seconds": 30}}]
EXPECTED_GATES = [
    {"signal": "ttft_p99_seconds", "comparison": "<=", "threshold": 0.8, "window_s": 60, "failure_limit": 2},
    {"signal": "kv_transfer_error_rate", "comparison": "<", "threshold": 1.5, "window_s": 30, "failure_limit": 0,
     "relative_to_stable": True, "role": "prefill"},
]
PLAN_FIELDS = ("name", "strategy", "target_model_version_id", "steps", "gates", "router_id", "max_surge",
               "progress_deadline_s", "max_weight_skew", "scale_down_delay_s", "worker_args", "state")


def _fields(plan: RolloutPlan) -> dict:
    return {**{f: getattr(plan, f) for f in PLAN_FIELDS}, "pools": sorted(plan.pools.values_list("pk", flat=True))}


def _checked(page, before: str) -> None:
    """Wait until the form's inline check that follows the last edit has answered."""
    page.wait_for_function(f"(document.getElementById('rollout-create').dataset.checked || '0') !== '{before}'")


def test_a_canary_built_in_the_editor_creates_the_same_plan_as_the_equivalent_json(
        server, browser, make_pool, make_model_version, cluster, operator_session):
    prefill, decode = make_pool("prefill", role="prefill", replicas=1), make_pool("decode", replicas=3)
    v2 = make_model_version("v2")
    router = router_create(name="router-a", cluster=cluster, url="http://127.0.0.1:12799")
    context, page, guard = signed_in(browser, server, "olga")
    page.goto(f"{server.base_url}/rollouts/")
    page.wait_for_selector("#rc-step-list li")
    assert page.locator("#rc-json").is_hidden()  # the editor first; JSON is the advanced view
    page.fill("#rc-name", "built-in-the-editor")
    page.select_option("#rc-pools", [str(prefill.pk), str(decode.pk)])
    page.select_option("#rc-router", str(router.pk))
    while page.locator("#rc-step-list .step-remove").count():  # start from no steps
        page.click("#rc-step-list li:first-child .step-remove")
    page.click("#rc-add-weight")
    page.fill("#rc-step-list li[data-index='0'] .step-weight-slider", "20")  # the slider
    assert page.input_value("#rc-step-list li[data-index='0'] .step-weight") == "20"
    page.click("#rc-add-pause")
    page.select_option("#rc-step-list li[data-index='1'] .step-pause-kind", "resume")
    page.click("#rc-add-weight")
    # Inline validation is the server's: a weight over 100 gets the validator's message on its row.
    before = page.evaluate("document.getElementById('rollout-create').dataset.checked || '0'")
    page.fill("#rc-step-list li[data-index='2'] .step-weight", "150")
    _checked(page, before)
    page.wait_for_selector("#rc-step-list li[data-index='2'].invalid")
    assert page.inner_text("#rc-step-list li[data-index='2'] .row-error") == (
        "Step 3: set_weight must be an integer percent in 0..100, got 150.")
    page.fill("#rc-step-list li[data-index='2'] .step-weight", "60")
    page.click("#rc-add-analysis")
    page.fill("#rc-step-list li[data-index='3'] .step-analysis-duration", "45")
    page.click("#rc-add-pause")
    page.fill("#rc-step-list li[data-index='4'] .step-pause-seconds", "30")
    page.click("#rc-add-gate")
    gate = "#rc-gate-list tr[data-index='0']"
    page.select_option(f"{gate} .gate-signal", "ttft_p99_seconds")
    assert page.inner_text(f"{gate} .gate-unit") == "s"  # the threshold's unit follows the signal
    page.select_option(f"{gate} .gate-comparison", "<=")
    page.fill(f"{gate} .gate-threshold", "0.8")
    page.fill(f"{gate} .gate-window", "60")
    page.fill(f"{gate} .gate-failure-limit", "2")
    page.click("#rc-add-gate")
    gate = "#rc-gate-list tr[data-index='1']"
    page.select_option(f"{gate} .gate-signal", "kv_transfer_error_rate")
    page.fill(f"{gate} .gate-threshold", "1.5")
    page.check(f"{gate} .gate-relative")
    page.select_option(f"{gate} .gate-role", "prefill")
    before = page.evaluate("document.getElementById('rollout-create').dataset.checked || '0'")
    page.fill("#rc-max-surge", "1")
    _checked(page, before)
    # The preview: the controller's split per step (prefill R=1 keeps a stable replica beside its canary).
    assert page.locator("#rc-step-list .invalid, #rc-gate-list .invalid").count() == 0
    cells = page.evaluate("Array.from(document.querySelectorAll('#rc-preview-table tbody tr'), r => "
                          "Array.from(r.cells, c => c.textContent))")
    assert cells[1] == ["1", "set weight 20%", "20%", "stable 1 · canary 1", "stable 2 · canary 1"]
    assert cells[3] == ["3", "set weight 60%", "60%", "stable 1 · canary 1", "stable 1 · canary 2"]
    page.screenshot(path=str(ARTIFACTS / "operator-rollout-editor.png"), full_page=True)
    page.click("#rc-submit")
    page.wait_for_selector("#rollout-state")
    built = RolloutPlan.objects.get(name="built-in-the-editor")
    built_fields = _fields(built)
    assert (built.steps, built.gates, built.target_model_version_id) == (EXPECTED_STEPS, EXPECTED_GATES, v2.pk)

    # The same plan typed as JSON in the advanced view (the first one removed: its pools are free again).
    rollout_plan_delete(plan=built)
    page.goto(f"{server.base_url}/rollouts/")
    page.wait_for_selector("#rc-step-list li")
    page.fill("#rc-name", "built-in-the-editor")
    page.select_option("#rc-pools", [str(prefill.pk), str(decode.pk)])
    page.select_option("#rc-router", str(router.pk))
    page.click("#rc-mode-json")
    page.fill("#rc-steps", json.dumps(EXPECTED_STEPS))
    page.fill("#rc-gates", json.dumps(EXPECTED_GATES))
    page.click("#rc-mode-form")  # and back: the editor shows what the JSON says
    assert page.locator("#rc-step-list li").count() == 5
    assert page.input_value("#rc-step-list li[data-index='2'] .step-weight-slider") == "60"
    assert page.input_value("#rc-gate-list tr[data-index='1'] .gate-role") == "prefill"
    page.click("#rc-mode-json")
    assert (json.loads(page.input_value("#rc-steps")), json.loads(page.input_value("#rc-gates"))) == (
        EXPECTED_STEPS, EXPECTED_GATES)  # the round trip changed nothing
    page.click("#rc-submit")
    page.wait_for_selector("#rollout-state")
    assert _fields(RolloutPlan.objects.get(name="built-in-the-editor")) == built_fields
    assert guard.remote == []
    context.close()


def _recorded(kind: str, target, at, params: dict):  # noqa: ANN001 - a Pool or RolloutPlan
    """An Action as the rollout recorded it, created at ``at`` (``created_at`` is set on insert: updated after)."""
    from apps.operations.models import Action

    target_type = "rollout" if isinstance(target, RolloutPlan) else "pool"
    action = Action.objects.create(kind=kind, target_type=target_type, target_id=str(target.pk), params=params,
                                   status=Action.Status.SUCCEEDED)
    Action.objects.filter(pk=action.pk).update(created_at=at)


def test_a_finished_rollouts_history_charts_each_weight_step_replicas_and_gate_measurements_at_their_times(
        server, browser, make_pool, make_model_version, operator_session):
    """Opened after the fact: weight, replicas per track and gate measurements drawn from the recorded Actions and
    measurements at their own times, and each step's start marked."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.rollouts.models import GateMeasurement

    pool = make_pool("chat", role="colocated", replicas=2)
    plan = RolloutPlan.objects.create(name="to-v2", target_model_version=make_model_version("v2"), strategy="canary",
                                      steps=[{"set_weight": 25}, {"set_weight": 50}],
                                      gates=[{"signal": "error_rate", "threshold": 0.05, "comparison": "<",
                                              "window_s": 30}])
    plan.pools.set([pool])
    RolloutPlan.objects.filter(pk=plan.pk).update(state="promoted", current_step_index=2, progress={
        "totals": {str(pool.pk): 2}, "stable_tracks": {str(pool.pk): "stable"}})
    t0 = timezone.now().replace(microsecond=0) - timedelta(minutes=10)

    def at(s: int):
        return t0 + timedelta(seconds=s)

    by = f"rollout:{plan.pk}"
    _recorded("rollout.start", plan, at(0), {})
    _recorded("pool.track_set", pool, at(10), {"track": "canary", "changes": {"created": True, "replicas": 0,
                                                                                "weight": 0}, "requester": by})
    _recorded("rollout.step", plan, at(20), {"step_index": 0, "step": {"set_weight": 25}})
    _recorded("pool.track_set", pool, at(21), {"track": "canary", "changes": {"replicas": 1}, "requester": by})
    _recorded("pool.track_set", pool, at(22), {"track": "canary", "changes": {"weight": 25}, "requester": by})
    _recorded("pool.track_set", pool, at(23), {"track": "stable", "changes": {"replicas": 1, "weight": 75},
                                               "requester": by})
    _recorded("rollout.step", plan, at(60), {"step_index": 1, "step": {"set_weight": 50}})
    _recorded("pool.track_set", pool, at(61), {"track": "canary", "changes": {"weight": 50}, "requester": by})
    _recorded("pool.track_set", pool, at(120), {"track": "canary", "changes": {"replicas": 2, "weight": 100},
                                                "requester": by})
    _recorded("pool.track_set", pool, at(121), {"track": "stable", "changes": {"replicas": 0}, "requester": by})
    _recorded("pool.track_set", pool, at(180), {"track": "stable", "changes": {"replicas": 2}, "requester": by})
    _recorded("pool.track_delete", pool, at(181), {"track": "canary", "requester": by})
    _recorded("pool.scale", pool, at(30), {"replicas": 5})  # not the rollout's: not charted
    for s, value, passed in ((30, 0.01, True), (40, 0.2, False)):
        GateMeasurement.objects.create(rollout=plan, step_index=1, gate_index=0, pool=pool, track="canary",
                                       signal="error_rate", value=value, threshold=0.05, comparison="<",
                                       window_s=30, passed=passed, measured_at=at(s))

    context, page, guard = signed_in(browser, server, "olga")
    page.goto(f"{server.base_url}/rollouts/{plan.pk}/")
    page.wait_for_selector("#steps li")
    t0_ms = t0.timestamp() * 1000

    def points(chart: str, trace: int, n: int) -> list:
        """The first ``n`` points of a trace as [seconds after t0, value] (live readings come after them)."""
        return page.evaluate(f"(d => d.x.slice(0, {n}).map((x, i) => [(new Date(x).getTime() - {t0_ms}) / 1000, "
                             f"d.y[i]]))(document.getElementById('{chart}').data[{trace}])")

    assert points("chart-canary-weight", 0, 5) == [[10, 0], [22, 25], [61, 50], [120, 100], [181, 0]]
    marks = page.evaluate(f"document.getElementById('chart-canary-weight').layout.shapes.map(s => "
                          f"[(new Date(s.x0).getTime() - {t0_ms}) / 1000, s.label.text])")
    assert marks == [[20, "step 1: set weight 25%"], [60, "step 2: set weight 50%"]]
    names = page.evaluate("document.getElementById('chart-replicas').data.map(t => t.name)")
    assert names[:2] == ["chat stable", "chat canary"]
    assert points("chart-replicas", 0, 4) == [[0, 2], [23, 1], [121, 0], [180, 2]]
    assert points("chart-replicas", 1, 4) == [[10, 0], [21, 1], [120, 2], [181, 0]]
    assert points("chart-gates", 0, 2) == [[30, 0.01], [40, 0.2]]
    assert page.evaluate("document.getElementById('chart-gates').data[0].marker.color") == ["#067647", "#b42318"]
    assert page.evaluate("document.getElementById('chart-gates').data[1].y") == [0.05, 0.05]  # the threshold
    page.wait_for_selector("#events tbody tr")
    page.wait_for_selector("#gates tr.gate-fail")  # the last measurement failed
    page.screenshot(path=str(ARTIFACTS / "operator-rollout-history.png"), full_page=True)
    assert guard.remote == []
    context.close()


def test_an_admin_registers_a_model_version_from_the_page_checked_by_the_api(server, browser, pool):
    """The register form: the API's own checks (a wrong expected SHA-256 of the local GGUF is refused with the
    file's digest, shown by the field), then the version registered from a built-in model; the table says which
    pools run each version."""
    from apps.accounts.services import user_create_with_role
    from apps.catalog.models import ModelVersion
    from apps.catalog.services import file_sha256
    from apps.dashboard.tests.live_stack import PASSWORD
    from inference_worker.registry import gguf_path

    user_create_with_role(username="ada", role="admin", password=PASSWORD)
    digest = file_sha256(gguf_path("gemma-3-270m"))
    context, page, guard = signed_in(browser, server, "ada")
    page.goto(f"{server.base_url}/model-versions/")
    page.wait_for_selector("#mv-register")
    row = f"#model-versions tr[data-model-version='{pool.model_version_id}']"
    assert page.inner_text(f"{row} td.pools") == f"{pool.cluster.name}/decode (decode; stable 2 replicas, 100%)"
    assert page.locator("#mv-gguf-path").is_hidden()  # the built-in source is the default
    page.fill("#mv-name", "gemma-3-270m")
    page.fill("#mv-version", "q4km")
    page.fill("#mv-sha256", "0" * 64)
    page.click("#mv-submit")
    wait_for_page(page, "document.getElementById('mv-sha256-error').textContent !== ''")
    assert f"has SHA-256 {digest}, not {'0' * 64}" in page.inner_text("#mv-sha256-error")
    assert not ModelVersion.objects.filter(name="gemma-3-270m").exists()
    page.fill("#mv-sha256", "")  # empty: the local file's own digest
    page.click("#mv-submit")
    page.wait_for_url("**/model-versions/?registered=*")
    mv = ModelVersion.objects.get(name="gemma-3-270m", version="q4km")
    assert (mv.sha256, mv.architecture_source, mv.num_sliding_layers) == (digest, "builtin:gemma-3-270m", 15)
    row = f"#model-versions tr[data-model-version='{mv.pk}']"
    assert page.get_attribute(f"{row} code.sha256", "title") == digest
    assert page.inner_text(f"{row} td.pools") == "no pool runs it"
    assert page.inner_text("#mv-result") == "Registered gemma-3-270m:q4km."
    page.screenshot(path=str(ARTIFACTS / "admin-model-versions-registered.png"), full_page=True)
    assert guard.remote == []
    context.close()
