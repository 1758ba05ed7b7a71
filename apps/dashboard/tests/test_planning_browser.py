"""Issue 24, acceptance 5: the planning page applies a recommendation computed from imported profile fixtures, and
the pools scale to exactly the recommended replicas on the local backend, with the Actions recorded.

Stack (as ``test_live_workers.py``): daphne (the module's), the local agent running real Gemma 3 270M workers, a
Celery worker executing the Actions and a reconcile loop standing in for beat. Two model workers at most: the
fixtures (``apps/planning/tests/fixtures``: a prefill pool twice as fast at prefill as the decode pool, whose
prefill is slow) over a 10 Gbit/s, 1 ms link recommend 1 prefill + 1 decode replica at 1 request/s. Then
``ferry_profile`` measures the decode pool's real worker (a short sweep) and stores a ``measured`` profile: batch
sizes 1 and 4 (workers with ``--max-num-seqs 4``), because on this loaded machine a Gemma 270M decode step of 2
sequences measured as fast as one of 1 (242 vs 228 ms: the fit's slope came out negative and the profile was
refused).
"""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command

from apps.dashboard.tests.live_stack import (
    ARTIFACTS,
    CHROMIUM,
    CeleryWorkerProcess,
    ReconcileLoop,
    purge_celery_queues,
    signed_in,
    wait_for_page,
)
from apps.fleet.models import Replica
from apps.fleet.services import cluster_create, cluster_link_create, pool_create
from apps.operations.models import Action
from apps.planning.models import PlanResult, Profile
from apps.planning.tests.conftest import FIXTURES, WORKLOAD
from inference_worker.tests.support.agent import AgentProcess, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium: apt-get install -y chromium"),
]
READY_TIMEOUT_S = 300
KV_LINK_SECRET = "planning-browser-kv-link-secret-0123456789"
WORKER_ENV = json.dumps({"TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "FERRY_KV_LINK_SECRET": KV_LINK_SECRET})


@pytest.fixture
def stack(tmp_path, settings, server):
    """Agent, Celery worker and the reconcile loop around ``server``."""
    agent = AgentProcess(tmp_path / "agent").launch()
    env = {"FERRY_AGENT_TOKEN": agent.token, "FERRY_WORKER_ENV": WORKER_ENV,
           "FERRY_WORKER_EXTRA_ARGS": "--max-num-seqs 4", "FERRY_ACTION_READY_TIMEOUT_S": "280",
           "FERRY_KV_LINK_SECRET": KV_LINK_SECRET}
    settings.FERRY_AGENT_TOKEN = agent.token  # reconcile runs in this process
    settings.FERRY_WORKER_ENV = WORKER_ENV
    settings.FERRY_WORKER_EXTRA_ARGS = "--max-num-seqs 4"
    purge_celery_queues()
    celery = CeleryWorkerProcess(tmp_path, env).launch()
    try:
        agent.wait_healthy()
        celery.wait_ready()
    except BaseException:
        celery.stop()
        agent.terminate()
        raise
    loop = ReconcileLoop(interval_s=2.0)
    loop.start()
    yield {"agent": agent, "celery": celery, "loop": loop}
    loop.stop()
    celery.stop(timeout_s=60)
    agent.terminate()


def ready(pool_id: int) -> int:
    return Replica.objects.filter(pool_id=pool_id, ready=True, alive=True).count()


def test_apply_from_the_planning_page_scales_both_pools_to_the_recommendation(
        stack, server, browser, operator_session, make_model_version):
    version = make_model_version("v1", name="gemma-3-270m")
    compute = cluster_create(name="dc-p", kind="local", agent_url=stack["agent"].base_url, datacenter="compute")
    bandwidth = cluster_create(name="dc-d", kind="local", agent_url=stack["agent"].base_url, datacenter="bandwidth")
    link = cluster_link_create(source=compute, destination=bandwidth, bandwidth_gbps=10.0, rtt_ms=1.0)
    prefill = pool_create(name="prefill", cluster=compute, role="prefill", model_version=version, replicas=0,
                          drain_timeout_s=10)
    decode = pool_create(name="decode", cluster=bandwidth, role="decode", model_version=version, replicas=0,
                         drain_timeout_s=10)

    context, page, guard = signed_in(browser, server, "olga")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server.base_url}/planning/")
    for pool, fixture in ((prefill, "prefill_profile.json"), (decode, "decode_profile_slow_prefill.json")):
        page.select_option("#import-pool", str(pool.pk))
        page.set_input_files("#import-file", str(FIXTURES / fixture))
        page.click("#import-submit", no_wait_after=True)
        wait_for_page(page, "document.getElementById('import-result').textContent.startsWith('Imported profile')",
                               timeout=30_000, polling=200)
        page.wait_for_function("document.querySelectorAll('#profiles tbody tr[data-profile]').length === "
                               f"{Profile.objects.count()}", timeout=30_000, polling=200)
    assert sorted(Profile.objects.values_list("pool_kind", "source")) == [("decode", "imported"), ("prefill", "imported")]

    page.select_option("#plan-prefill", str(prefill.pk))
    page.select_option("#plan-decode", str(decode.pk))
    page.select_option("#plan-link", str(link.pk))
    # The fixture's workload (WORKLOAD, as the service tests plan it), not the page's demo-sized start.
    for field, key in (("prompt-median", "prompt_median"), ("prompt-p90", "prompt_p90"), ("prompt-cap", "prompt_cap"),
                       ("output-median", "output_median"), ("rate", "rate_per_s"), ("ttft", "ttft_slo_s"),
                       ("tpot", "tpot_slo_s"), ("attainment", "attainment")):
        page.fill(f"#plan-{field}", str(WORKLOAD[key]))
    page.click("#plan-submit", no_wait_after=True)
    page.wait_for_selector("#plan-result:not([hidden])", timeout=60_000)
    assert page.text_content("#rec-prefill-replicas") == "1 (dc-p/prefill)"
    assert page.text_content("#rec-decode-replicas") == (
        "1 (dc-d/decode: each replica decodes and prefills the prompts that stay local)")
    assert page.text_content("#rec-threshold") == "prompts over 0 tokens prefill remotely"
    assert page.evaluate("document.getElementById('chart-ttft').data.length") == 3
    plan = PlanResult.objects.get()
    assert (plan.prefill_replicas, plan.decode_replicas, plan.threshold_tokens) == (1, 1, 0)

    page.click("#plan-apply", no_wait_after=True)
    page.wait_for_function("document.querySelectorAll('#apply-steps li').length === 3", timeout=30_000, polling=200)
    assert page.text_content("#apply-steps li[data-step='set_bounds']") == (
        "set bounds on dc-d/decode: skipped — the plan prefills every prompt remotely")
    scale = list(Action.objects.filter(kind="pool.scale").order_by("id"))
    assert [(a.pool_id, a.params, a.requested_by.username) for a in scale] == [
        (prefill.pk, {"replicas": 1}, "olga"), (decode.pk, {"replicas": 1}, "olga")]

    assert wait_for(lambda: ready(prefill.pk) == 1 and ready(decode.pk) == 1, READY_TIMEOUT_S), (
        stack["celery"].log()[-3000:], stack["loop"].errors)
    assert wait_for(lambda: not Action.objects.filter(status__in=Action.ACTIVE_STATUSES).exists(), 60)
    # Each pool.scale ran one pool.track_set (stable: 0 -> 1) on its pool, requested by olga; all succeeded.
    assert sorted((a.kind, a.target_id, a.params["track"] if a.kind == "pool.track_set" else "", a.status)
                  for a in Action.objects.all()) == sorted(
        [("pool.scale", str(p.pk), "", "succeeded") for p in (prefill, decode)]
        + [("pool.track_set", str(p.pk), "stable", "succeeded") for p in (prefill, decode)])
    assert [t.replicas for t in prefill.tracks.all()] == [1] and [t.replicas for t in decode.tracks.all()] == [1]
    page.wait_for_function("document.querySelectorAll('#measured tbody tr').length === 2", timeout=30_000,
                           polling=500)
    page.screenshot(path=str(ARTIFACTS / "planning-applied.png"), full_page=True, timeout=120_000)
    # After a reload the plan is listed: Open shows it again, its steps and predicted vs measured.
    page.reload()
    page.wait_for_selector(f"#plans tbody tr[data-plan='{plan.pk}']", timeout=30_000)
    assert page.text_content(f"#plans tbody tr[data-plan='{plan.pk}'] td:nth-child(5)") == "1 + 1"
    page.click(f"#plans button[data-open='{plan.pk}']")
    page.wait_for_selector("#plan-result:not([hidden])", timeout=30_000)
    assert page.text_content("#plan-id") == f"plan #{plan.pk}"
    assert page.eval_on_selector_all("#apply-steps li", "ls => ls.length") == 3
    page.wait_for_function("document.querySelectorAll('#measured tbody tr').length === 2", timeout=30_000,
                           polling=500)
    assert guard.remote == [] and errors == []

    # ferry_profile on the decode pool's real worker: a short sweep, stored as a measured profile.
    # Batch sizes 1-3, the batches the demo runs at. Under the suite's load a slow round can tilt the step's line
    # below 0 at B = 0 (CI: 80, 156, 240 ms): the fit is refused as a retryable Action, and like an operator the
    # test profiles again, at most 3 times; any other failure fails at once.
    for attempt in range(3):
        out = io.StringIO()
        try:
            call_command("ferry_profile", "dc-d/decode", "--hardware-label", "cpu-test", "--lengths", "16,32,64",
                         "--batch-sizes", "1,2,3", "--max-new-tokens", "8", stdout=out)
            break
        except CommandError as exc:
            failed = Action.objects.filter(kind="pool.profile").latest("id")
            if attempt == 2 or "could not be fitted" not in str(failed.error):
                raise AssertionError(f"{exc}; log: {failed.log}") from exc
    measured = Profile.objects.get(source="measured")
    assert (measured.pool_id, measured.pool_kind, measured.hardware_label) == (decode.pk, "decode", "cpu-test")
    assert [n for n, _ in measured.prefill_points] == [16, 32, 64]
    assert [b for b, _ in measured.decode_points] == [1, 2, 3]
    assert all(s > 0 for _, s in measured.prefill_points + measured.decode_points)
    # A decode pool prefills short prompts itself: its prefill is measured again while one stream decodes.
    assert [n for n, _ in measured.colocated_prefill_points] == [16, 32, 64]
    assert all(s > 0 for _, s in measured.colocated_prefill_points)
    action = Action.objects.filter(kind="pool.profile").latest("id")
    messages = [line["message"] for line in action.log]
    assert action.status == "succeeded" and messages[-2:] == [f"stored profile #{measured.pk}", "succeeded"]
    assert "; prefill while decoding 16 tok " in messages[-3]
    print("measured profile:", measured.prefill_points, measured.decode_points, messages[-3])
    # Delete the plan from the page (after the browser's confirmation): the listing and the open plan go.
    page.once("dialog", lambda dialog: dialog.accept())
    page.click(f"#plans button[data-delete='{plan.pk}']")
    page.wait_for_selector(f"#plans tbody tr[data-plan='{plan.pk}']", state="detached", timeout=30_000)
    assert not PlanResult.objects.exists() and page.is_hidden("#plan-result") and errors == []
    context.close()
