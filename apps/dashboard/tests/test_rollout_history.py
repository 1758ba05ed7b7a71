"""The rollout page's history (``selectors.rollout_weight_history``) and state as a new user reads them.

A new user rolled v2 back and saw the rollback's single step go 0 -> 100 -> 50 -> 0% and the rollout end
``promoted``: the chart drew the canary *track*'s weight, which falls back to 50% while the stable track takes the new
version in the finalize (both tracks then run it: traffic split by ready replicas) and to 0 when the canary track is
removed. The chart now draws the traffic on the target *version*; the state machine's ``promoted`` stays, labelled
``rolled back`` for a rollback rollout.
"""

from __future__ import annotations

import re

import pytest

from apps.dashboard.selectors import rollout_detail, rollout_weight_history, target_share
from apps.operations.models import Action
from apps.rollouts.services import rollout_plan_create, rollout_rollback, rollout_start
from apps.rollouts.tests.conftest import drive, observe

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("replicas", "climb"), [(1, [0, 100]), (3, [0, 33, 66, 100])])
def test_traffic_on_the_target_climbs_to_100_and_stays_through_the_finalize_for_a_release_and_its_rollback(
        make_pool, make_model_version, operator_session, replicas, climb):
    pool = make_pool("chat", role="colocated", replicas=replicas)
    observe(pool)
    plan = rollout_plan_create(pools=[pool], target_model_version=make_model_version("v2"), name="to-v2",
                               strategy="canary", steps=[{"set_weight": 100}])
    rollout_start(plan=plan)
    drive(plan)

    def charted(rollout) -> list[int]:  # noqa: ANN001 - a RolloutPlan
        return [value for _, value in rollout_weight_history(rollout)[str(pool.pk)]]

    assert charted(plan) == climb
    back = rollout_rollback(plan=plan)
    drive(back)
    assert charted(back) == climb  # v1 coming back: never "through 50%", never ending at 0
    detail, original = rollout_detail(back.pk), rollout_detail(plan.pk)
    assert (detail["state"], detail["state_label"], detail["message"]) == (
        "promoted", "rolled back", f"Rolled back: every pool runs {plan.stable_model_version} again (rollback of "
        f"rollout #{plan.pk}).")
    assert (original["state"], original["state_label"], original["rollbacks"]) == ("promoted", "promoted", [back.pk])
    # its log says why a canary weight falls during the finalize (both tracks run v1 by then)
    logs = [e["message"] for a in Action.objects.filter(target_type="rollout", target_id=str(back.pk)) for e in a.log]
    finalize = re.compile(rf"canary weight 100% -> \d+% \(by ready replicas: both tracks run "
                          rf"{re.escape(str(plan.stable_model_version))}, which keeps all the traffic\)")
    assert any(finalize.search(m) for m in logs), logs
    # the pages say so too: the list's state cell and the rollout page's state (the machine's state in data-state)
    listed = operator_session.get("/rollouts/").content.decode()
    assert listed.count('data-state="promoted">rolled back</td>') == 1
    assert listed.count('data-state="promoted">promoted</td>') == 1
    page = operator_session.get(f"/rollouts/{back.pk}/").content.decode()
    assert ('<strong id="rollout-state" class="state state-promoted" data-state="promoted" title="state promoted">'
            'rolled back</strong>') in page


def test_an_aborted_canary_charts_its_traffic_going_back_to_0(make_pool, make_model_version):
    from apps.rollouts.services import rollout_abort

    pool = make_pool("chat", role="colocated", replicas=2)
    observe(pool)
    plan = rollout_plan_create(pools=[pool], target_model_version=make_model_version("v2"), name="to-v2",
                               strategy="canary", steps=[{"set_weight": 50}, {"pause": {}}])
    rollout_start(plan=plan)
    drive(plan, until=("paused",))
    rollout_abort(plan=plan)
    drive(plan, until=("aborted",))
    assert [v for _, v in rollout_weight_history(plan)[str(pool.pk)]] == [0, 50, 0]


def test_target_share_counts_the_weights_of_the_tracks_running_the_target():
    assert target_share({"stable": 50, "canary": 50}, {"stable": "v1", "canary": "v2"}, "v2") == 50
    assert target_share({"stable": 50, "canary": 50}, {"stable": "v2", "canary": "v2"}, "v2") == 100  # finalize
    assert target_share({"stable": 100, "canary": 0}, {"stable": "v1", "canary": "v2"}, "v2") == 0
    assert target_share({"stable": 0}, {"stable": "v2"}, "v2") == 100  # alone: everything, whatever its weight
    # the finalize's two weight writes are recorded one after the other: 0 + 0 between them is still all on v2
    assert target_share({"stable": 0, "canary": 0}, {"stable": "v2", "canary": "v2"}, "v2") == 100
    assert target_share({"stable": 100}, {"stable": "v1"}, "v2") == 0
