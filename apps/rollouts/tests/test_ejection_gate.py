"""The router's ejections as a rollout gate: a canary replica ejected by the circuit breaker aborts the rollout,
and the abort names the signal."""

import pytest

from apps.operations.models import Action
from apps.rollouts.models import GateMeasurement
from apps.rollouts.tests.conftest import drive, table_weights
from apps.rollouts.tests.test_gates import _plan, _record


@pytest.mark.django_db
def test_an_ejected_canary_replica_fails_the_gate_and_the_abort_names_it(make_pool, v2, settings, default_history):
    gate = {"signal": "ejected_replicas", "threshold": 1, "comparison": "<", "window_s": 30, "failure_limit": 0}
    pool, plan = _plan(make_pool, v2, [gate], settings)
    _record(default_history, pool, {"router_ejected_replicas": 1.0}, {"router_ejected_replicas": 0.0})
    drive(plan, until=("aborted",))
    plan.refresh_from_db()
    row = GateMeasurement.objects.filter(rollout=plan).latest("id")
    detail = "router_ejected_replicas of dc-a/decode canary = 1 (worst of 1 records); needs < 1"
    assert (row.value, row.passed, row.detail) == (1.0, False, detail)
    assert plan.message == f"gate 1 failed 1 time(s) in a row: {detail}"
    assert Action.objects.get(kind="rollout.abort", target_id=str(plan.pk)).log[1]["message"] == plan.message
    assert table_weights() == {"canary": ("v2", 0), "stable": ("v1", 100)}


@pytest.mark.django_db
def test_no_ejection_passes_the_gate(make_pool, v2, settings, default_history):
    gate = {"signal": "ejected_replicas", "threshold": 1, "comparison": "<", "window_s": 30}
    pool, plan = _plan(make_pool, v2, [gate], settings)
    _record(default_history, pool, {"router_ejected_replicas": 0.0})
    drive(plan, until=("paused",))
    assert list(GateMeasurement.objects.filter(rollout=plan).values_list("value", "passed")) == [(0.0, True)]
