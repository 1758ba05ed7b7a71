"""Browser tests of the rollout editor, a rollout's history and model version registration (Playwright, Debian's
Chromium, the ASGI app under daphne: the fixtures of ``test_browser.py``)."""

from __future__ import annotations

import json

import pytest

from apps.dashboard.tests.live_stack import ARTIFACTS, CHROMIUM, signed_in
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
    assert (built.steps, built.gates) == (EXPECTED_STEPS, EXPECTED_GATES)

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
