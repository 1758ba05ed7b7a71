"""Gates: worst value over the window, no data never passes, relative to stable, N consecutive failures abort
with the failing measurement recorded; a passing analysis lets the rollout continue."""

import time

import pytest

from apps.operations.models import Action
from apps.rollouts import services
from apps.rollouts.gates import compare, gate_worst_value
from apps.rollouts.models import GateMeasurement
from apps.rollouts.tests.conftest import drive, observe, table_weights

RECORDS = [
    {"at": 1.0, "tracks": {"canary": {"ttft_p99_s": 0.30, "error_rate": 0.0}, "stable": {"ttft_p99_s": 0.20}}},
    {"at": 2.0, "tracks": {"canary": {"ttft_p99_s": 0.50, "error_rate": None}, "stable": {"ttft_p99_s": 0.25}}},
    {"at": 3.0, "tracks": {"canary": {"ttft_p99_s": 0.40}, "stable": {"ttft_p99_s": None}}},
]


def test_worst_value_is_max_for_upper_bounds_and_min_for_lower_bounds():
    assert gate_worst_value(RECORDS, track="canary", signal="ttft_p99_s", comparison="<") == 0.5
    assert gate_worst_value(RECORDS, track="canary", signal="ttft_p99_s", comparison=">=") == 0.3


def test_relative_to_stable_divides_per_record_and_skips_missing_stable():
    assert gate_worst_value(RECORDS, track="canary", signal="ttft_p99_s", comparison="<",
                            stable_track="stable") == 2.0  # 0.5 / 0.25; the record without stable is skipped


def test_no_data_never_passes():
    assert gate_worst_value(RECORDS, track="canary", signal="tpot_p99_s", comparison="<") is None
    assert gate_worst_value([], track="canary", signal="error_rate", comparison="<") is None
    assert compare(None, "<", 1.0) is False
    assert compare(float("nan"), ">", 0.0) is False
    assert compare(0.0, "<=", 0.0) is True


def _plan(make_pool, v2, gates, settings):
    settings.FERRY_ROLLOUT_TICK_S = 0
    pool = make_pool("decode", role="colocated", replicas=2)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="gated", strategy="canary",
                                        steps=[{"set_weight": 50}, {"analysis": {}}, {"pause": {}}], gates=gates)
    services.rollout_start(plan=plan)
    return pool, plan


def _record(default_history, pool, canary: dict, stable: dict | None = None) -> None:
    now = time.time()
    default_history.append(f"pool:{pool.pk}", now, {"at": now, "signals": {},
                                             "tracks": {"canary": canary, "stable": stable or {}}})


@pytest.mark.django_db
def test_no_data_fails_the_gate_and_aborts_after_the_failure_limit(make_pool, v2, settings, default_history):
    gate = {"signal": "error_rate", "threshold": 0.05, "comparison": "<", "window_s": 30, "failure_limit": 1}
    pool, plan = _plan(make_pool, v2, [gate], settings)
    drive(plan, until=("aborted",))
    plan.refresh_from_db()
    rows = list(GateMeasurement.objects.filter(rollout=plan).order_by("id"))
    assert [(m.value, m.passed, m.consecutive_failures) for m in rows] == [(None, False, 1), (None, False, 2)]
    detail = "no data for error_rate of dc-a/decode canary in the last 30s"
    assert rows[-1].detail == detail
    assert plan.message == f"gate 1 failed 2 time(s) in a row: {detail}"
    abort = Action.objects.get(kind="rollout.abort", target_id=str(plan.pk))
    assert abort.log[1]["message"] == plan.message
    assert table_weights() == {"canary": ("v2", 0), "stable": ("v1", 100)}


@pytest.mark.django_db
def test_failing_measurement_is_recorded_with_its_value(make_pool, v2, settings, default_history):
    gate = {"signal": "ttft_p99_seconds", "threshold": 1.5, "comparison": "<", "window_s": 30,
            "relative_to_stable": True}
    pool, plan = _plan(make_pool, v2, [gate], settings)
    _record(default_history, pool, {"ttft_p99_s": 0.5}, {"ttft_p99_s": 0.2})
    drive(plan, until=("aborted",))
    plan.refresh_from_db()
    m = GateMeasurement.objects.get(rollout=plan)
    assert (m.signal, m.value, m.passed, m.track) == ("ttft_p99_seconds", 2.5, False, "canary")
    assert plan.message == ("gate 1 failed 1 time(s) in a row: ttft_p99_s of dc-a/decode canary/stable = 2.5 "
                            "(worst of 1 records); needs < 1.5")


@pytest.mark.django_db
def test_passing_analysis_lets_the_rollout_continue(operator_api, make_pool, v2, settings, default_history):
    gates = [{"signal": "error_rate", "threshold": 0.05, "comparison": "<", "window_s": 30},
             {"signal": "tpot_p99_seconds", "threshold": 0.2, "comparison": "<=", "window_s": 30}]
    pool, plan = _plan(make_pool, v2, gates, settings)
    _record(default_history, pool, {"error_rate": 0.0, "tpot_p99_s": 0.05})
    _record(default_history, pool, {"error_rate": 0.01, "tpot_p99_s": 0.2})
    drive(plan, until=("paused",))
    plan.refresh_from_db()
    assert plan.current_step_index == 3
    values = sorted((m.signal, m.value, m.passed) for m in GateMeasurement.objects.filter(rollout=plan))
    assert values == [("error_rate", 0.01, True), ("tpot_p99_seconds", 0.2, True)]
    body = operator_api.get(f"/api/v1/rollout-measurements/?rollout={plan.pk}").json()
    assert body["count"] == 2


@pytest.mark.django_db
def test_a_ttft_gate_evaluates_on_a_vllm_pool_from_the_engines_own_metrics(make_cluster, model_version, v2, settings,
                                                                           default_history):
    """A vLLM pool under a canary: the real poller reads the canary replica's vLLM page (documented names, served in
    the text format), writes the history the gate reads, and the TTFT p99 gate measures the hand-computed value."""
    from apps.fleet.services import pool_create
    from apps.telemetry.endpoints import ReplicaEndpoint
    from apps.telemetry.poller import TelemetryPoller
    from apps.telemetry.tests.engine_exporters import VllmExporter, serve_text_format

    settings.FERRY_ROLLOUT_TICK_S = 0
    settings.FERRY_PROMETHEUS_URL = ""  # direct scrape
    kube = make_cluster("k8s-v", kind="kubernetes", agent_url="", namespace="ferry", in_cluster=True)
    pool = pool_create(name="chat", cluster=kube, role="colocated", model_version=model_version, replicas=2,
                       engine="vllm")
    observe(pool)
    gate = {"signal": "ttft_p99_seconds", "threshold": 0.2, "comparison": "<", "window_s": 30, "failure_limit": 1}
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="vllm-canary", strategy="canary",
                                        steps=[{"set_weight": 50}, {"pause": {}}, {"analysis": {}}, {"pause": {}}],
                                        gates=[gate])
    services.rollout_start(plan=plan)
    drive(plan, until=("paused",))  # the canary track exists, at 50%

    exporter = VllmExporter()
    server = serve_text_format(exporter.registry)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    poller = TelemetryPoller(history=default_history, window_s=10,
                             endpoints=lambda: [ReplicaEndpoint(str(pool.pk), "canary", "chat-canary-0", url,
                                                                engine="vllm", pool_name="chat")])
    try:
        poller.poll_once()
        for _ in range(2):
            time.sleep(0.5)  # samples are stamped at scrape time
            for ttft in (0.05,) * 7 + (0.3,) * 2:  # 7 in (0.04, 0.06], 2 in (0.25, 0.5]
                exporter.ttft.observe(ttft)
            poller.poll_once()
    finally:
        server.shutdown()
        server.server_close()
    services.rollout_resume(plan=plan)
    drive(plan, until=("aborted",))
    plan.refresh_from_db()
    measured = GateMeasurement.objects.filter(rollout=plan).order_by("id").first()
    # p99: the same 9 observations per interval, rank 8.91 of 9 in (0.25, 0.5]: 0.25 + 0.25 * 1.91 / 2.
    assert (measured.signal, measured.track, measured.passed) == ("ttft_p99_seconds", "canary", False)
    assert measured.value == pytest.approx(0.25 + 0.25 * 1.91 / 2, rel=1e-9)
    assert plan.state == "aborted"
