"""A rollout waiting on replicas that die names why: the replicas' exit code, restarts and termination
message (a worker whose model fails to load writes the error there and exits non-zero), in the
waiting message and in the progress-deadline failure."""

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.fleet.models import Replica
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.tests.conftest import observe

pytestmark = pytest.mark.django_db

LOAD_ERROR = "model failed to load: ValueError: --model 'gemma-3-270m-v2' is neither a built-in model"


def test_a_canary_that_keeps_dying_is_named_in_the_waiting_message_and_the_failure(make_pool, make_model_version):
    pool = make_pool("decode", role="colocated", replicas=3)
    observe(pool)
    v2 = make_model_version("v2")
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="gemma v2", strategy="canary",
                                        steps=[{"set_weight": 33}], progress_deadline_s=5)
    services.rollout_start(plan=plan)
    assert rollout_tick(rollout_id=plan.pk) == "set_weight"  # one canary replica desired
    observe(pool, tracks=("stable",))  # the stable replicas are there; the canary replica ...
    Replica.objects.create(pool=pool, track="canary", name="decode-canary-0", alive=False, ready=False,
                           version="v2", restart_count=2, exit_code=3, message=LOAD_ERROR,
                           last_seen=timezone.now())  # ... as reconcile observed it: dead, said why
    plan.refresh_from_db()
    assert rollout_tick(rollout_id=plan.pk, now=plan.step_started_at + timedelta(seconds=4)) == "waiting"
    plan.refresh_from_db()
    named = f"decode: replica decode-canary-0 is not running (exit code 3, 2 restarts): {LOAD_ERROR}"
    assert plan.message == f"Waiting for dc-a/decode canary: 0 of 1 replica ready ({named})."
    assert rollout_tick(rollout_id=plan.pk, now=plan.step_started_at + timedelta(seconds=6)) == "failed"
    plan.refresh_from_db()
    assert (plan.state, plan.message) == (
        "failed", f"progress deadline of 5s exceeded while waiting for dc-a/decode canary: 0 of 1 replica ready "
                  f"({named})")
