"""``POST /api/v1/rollouts/validate/`` (create's checks, nothing saved) and ``/preview/`` (what each step will do,
from the controller's replica math), as the rollout editor calls them."""

import pytest

from apps.rollouts.models import RolloutPlan

pytestmark = pytest.mark.django_db

GATES = [{"signal": "error_rate", "threshold": 0.05, "comparison": "<", "window_s": 30, "failure_limit": 1}]


@pytest.fixture
def pd_pools(make_pool):
    return make_pool("prefill", role="prefill", replicas=1), make_pool("decode", role="decode", replicas=3)


def _body(pools, target, **over):
    return {"name": "to v2", "pools": [p.pk for p in pools], "target_model_version": target.pk,
            "strategy": "canary", "steps": [{"set_weight": 10}, {"pause": {"seconds": 20}}, {"set_weight": 50},
                                            {"analysis": {"duration_s": 60}}], "gates": GATES, **over}


def test_validate_answers_valid_and_saves_nothing(operator_api, pd_pools, v2):
    r = operator_api.post("/api/v1/rollouts/validate/", _body(pd_pools, v2), format="json")
    assert (r.status_code, r.json()) == (200, {"valid": True})
    assert RolloutPlan.objects.count() == 0


@pytest.mark.parametrize(("over", "expected"), [
    ({"steps": [{"set_weight": 101}]},
     {"steps": ["Step 1: set_weight must be an integer percent in 0..100, got 101."]}),
    ({"gates": [{**GATES[0], "window_s": 0}]}, {"gates": ["Gate 1: window_s must be an integer in 1..86400."]}),
    ({"steps": []}, {"steps": ['A canary rollout needs at least one step (e.g. {"set_weight": 10}).']}),
])
def test_validate_returns_the_servers_own_messages_per_field(operator_api, pd_pools, v2, over, expected):
    for url in ("/api/v1/rollouts/validate/", "/api/v1/rollouts/preview/"):
        r = operator_api.post(url, _body(pd_pools, v2, **over), format="json")
        assert (r.status_code, r.json()) == (400, expected)


def test_validate_checks_the_pools_as_create_does(operator_api, pd_pools, v2, model_version, viewer_api):
    r = operator_api.post("/api/v1/rollouts/validate/", _body(pd_pools[1:], v2), format="json")
    assert r.status_code == 400 and "include both the prefill and the decode pool" in r.json()["pools"][0]
    r = operator_api.post("/api/v1/rollouts/validate/", _body(pd_pools, model_version), format="json")
    assert r.json() == {"target_model_version": ["The pools already run this version."]}
    assert viewer_api.post("/api/v1/rollouts/validate/", _body(pd_pools, v2), format="json").status_code == 403


def test_preview_lists_replicas_per_track_per_pool_and_weight_from_the_controllers_split(operator_api, pd_pools, v2):
    prefill, decode = (str(p.pk) for p in pd_pools)
    r = operator_api.post("/api/v1/rollouts/preview/", _body(pd_pools, v2), format="json")
    assert r.status_code == 200, r.json()
    body = r.json()
    assert [(p["name"], p["total"], p["stable_track"], p["new_track"]) for p in body["pools"]] == [
        ("prefill", 1, "stable", "canary"), ("decode", 3, "stable", "canary")]
    rows = [(row["number"], row["text"], row["weight"], row["replicas"][prefill], row["replicas"][decode])
            for row in body["rows"]]
    assert rows == [
        (None, "start: canary track created", 0, {"stable": 1, "canary": 0}, {"stable": 3, "canary": 0}),
        # R=1 at 10%: one surge canary beside the stable replica; R=3: ceil(0.3) = 1 canary
        (1, "set weight 10%", 10, {"stable": 1, "canary": 1}, {"stable": 2, "canary": 1}),
        (2, "pause 20 s", 10, {"stable": 1, "canary": 1}, {"stable": 2, "canary": 1}),
        (3, "set weight 50%", 50, {"stable": 1, "canary": 1}, {"stable": 1, "canary": 2}),
        (4, "analysis for 60 s", 50, {"stable": 1, "canary": 1}, {"stable": 1, "canary": 2}),
        (None, "all steps done: canary weight to 100%", 100, {"stable": 0, "canary": 1}, {"stable": 0, "canary": 3}),
        (None, "finalize: the stable tracks take the new version, the canary track is removed", 100,
         {"stable": 1}, {"stable": 3}),
    ]
    assert body["errors"] == [] and RolloutPlan.objects.count() == 0


def test_preview_names_a_step_the_controller_would_refuse_without_surge(operator_api, pd_pools, v2):
    r = operator_api.post("/api/v1/rollouts/preview/", _body(pd_pools, v2, max_surge=0), format="json")
    assert r.status_code == 200
    assert r.json()["errors"] == [
        "pool prefill: weight 10% on 1 replica(s) needs 1 canary replica(s), leaving none for the 90% of traffic "
        "that stays on stable; set max_surge >= 1 (one extra stable replica) or use weight 100.",
        "pool prefill: weight 50% on 1 replica(s) needs 1 canary replica(s), leaving none for the 50% of traffic "
        "that stays on stable; set max_surge >= 1 (one extra stable replica) or use weight 100."]
    assert [row["number"] for row in r.json()["rows"] if row["error"]] == [1, 3]


def test_preview_of_blue_green_shows_the_preview_track_then_the_switch(operator_api, pd_pools, v2):
    decode = str(pd_pools[1].pk)
    r = operator_api.post("/api/v1/rollouts/preview/", _body(pd_pools, v2, strategy="blue_green",
                                                               steps=[{"pause": {}}]), format="json")
    assert r.status_code == 200, r.json()
    assert [(row["text"], row["weight"], row["replicas"][decode]) for row in r.json()["rows"]] == [
        ("start: preview tracks at the pool total, no traffic (then smoke check)", 0, {"stable": 3, "green": 3}),
        ("pause until resumed", 0, {"stable": 3, "green": 3}),
        ("switch: all traffic to the new version", 100, {"stable": 3, "green": 3}),
        ("30 s later: the old track scales to 0", 100, {"stable": 0, "green": 3}),
    ]
