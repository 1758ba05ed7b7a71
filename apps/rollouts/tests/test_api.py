"""Rollout plans: create/list/filter/update/delete and validation of pools, steps and gates."""

import pytest

from apps.rollouts.models import RolloutPlan

pytestmark = pytest.mark.django_db

STEPS = [{"set_weight": 10}, {"pause": {"seconds": 60}}, {"analysis": {"duration_s": 120}}, {"set_weight": 50},
         {"pause": {}}]
GATES = [{"signal": "ttft_p99_seconds", "threshold": 0.5, "comparison": "<", "window_s": 60, "failure_limit": 1},
         {"signal": "kv_transfer_error_rate", "threshold": 0.01, "comparison": "<=", "window_s": 60}]


@pytest.fixture
def pd_pools(make_pool):
    return make_pool("prefill", role="prefill"), make_pool("decode", role="decode")


@pytest.fixture
def v2(make_model_version):
    return make_model_version("v2")


def _body(pool_objs, target, **over):
    return {"name": "gemma v2", "pools": [p.pk for p in pool_objs], "target_model_version": target.pk,
            "strategy": "canary", "steps": STEPS, "gates": GATES, **over}


def test_rollout_create_list_filter_update_delete(operator_api, pd_pools, v2):
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2), format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert (body["state"], body["current_step_index"], body["next_step_at"], body["created_by"]) == (
        "pending", 0, None, "otto")
    assert sorted(body["pools"]) == sorted(p.pk for p in pd_pools)
    assert operator_api.get(f"/api/v1/rollouts/?pool={pd_pools[0].pk}").json()["count"] == 1
    assert operator_api.get("/api/v1/rollouts/?state=progressing").json()["count"] == 0
    r = operator_api.patch(f"/api/v1/rollouts/{body['id']}/", {"steps": [{"set_weight": 25}], "max_surge": 2},
                           format="json")
    assert r.status_code == 200, r.json()
    assert (r.json()["steps"], r.json()["max_surge"]) == ([{"set_weight": 25}], 2)
    assert operator_api.delete(f"/api/v1/rollouts/{body['id']}/").status_code == 204
    assert RolloutPlan.objects.count() == 0


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"steps": [{"set_weight": 101}]}, "steps"),
        ({"steps": [{"set_weight": -5}]}, "steps"),
        ({"steps": [{"pause": {"seconds": 0}}]}, "steps"),
        ({"steps": [{"jump": 1}]}, "steps"),
        ({"steps": [{"set_weight": 10, "pause": {}}]}, "steps"),
        ({"steps": []}, "steps"),
        ({"strategy": "blue_green", "steps": [{"set_weight": 50}]}, "steps"),
        ({"gates": [{"signal": "vibes", "threshold": 1, "comparison": "<", "window_s": 60}]}, "gates"),
        ({"gates": [{"signal": "error_rate", "threshold": 1, "comparison": "==", "window_s": 60}]}, "gates"),
        ({"gates": [{"signal": "error_rate", "threshold": 1, "comparison": "<", "window_s": 0}]}, "gates"),
        ({"strategy": "yolo"}, "strategy"),
        ({"pools": []}, "pools"),
    ],
)
def test_invalid_plan_returns_400_with_field(operator_api, pd_pools, v2, over, field):
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, **over), format="json")
    assert r.status_code == 400
    assert field in r.json(), r.json()


def test_step_weight_message_names_the_step(operator_api, pd_pools, v2):
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, steps=[{"set_weight": 10}, {"set_weight": 150}]),
                          format="json")
    assert r.json() == {"steps": ["Step 2: set_weight must be an integer percent in 0..100, got 150."]}


def test_prefill_pool_without_its_decode_pool_is_400(operator_api, pd_pools, v2):
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools[:1], v2), format="json")
    assert r.status_code == 400
    assert "include both the prefill and the decode pool" in r.json()["pools"][0]


def test_pools_on_different_versions_or_already_on_target_are_400(operator_api, make_pool, pd_pools, v2,
                                                                    make_model_version):
    other = make_pool("colocated", role="colocated", model_version=v2)
    r = operator_api.post("/api/v1/rollouts/", _body([*pd_pools, other], make_model_version("v3")), format="json")
    assert r.json() == {"pools": ["All pools must currently run the same stable model version."]}
    r = operator_api.post("/api/v1/rollouts/", _body([other], v2), format="json")
    assert r.json() == {"target_model_version": ["The pools already run this version."]}


def test_pool_in_an_active_rollout_is_409(operator_api, pd_pools, v2):
    assert operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2), format="json").status_code == 201
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, name="again"), format="json")
    assert r.status_code == 409
    assert r.json()["detail"] == "Pool dc-a/prefill is already in rollout 'gemma v2' (pending)."


def test_started_plan_cannot_be_changed_or_deleted(operator_api, pd_pools, v2):
    pid = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2), format="json").json()["id"]
    RolloutPlan.objects.filter(pk=pid).update(state=RolloutPlan.State.PROGRESSING)
    r = operator_api.patch(f"/api/v1/rollouts/{pid}/", {"max_surge": 3}, format="json")
    assert r.status_code == 409
    assert r.json()["detail"] == "Rollout 'gemma v2' is progressing; only pending plans can be changed."
    assert operator_api.delete(f"/api/v1/rollouts/{pid}/").status_code == 409


def test_blue_green_with_pause_and_analysis_is_valid(operator_api, pd_pools, v2):
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, strategy="blue_green",
                                                     steps=[{"analysis": {"gates": GATES}}, {"pause": {}}]),
                          format="json")
    assert r.status_code == 201, r.json()


def test_viewer_cannot_create_rollouts(viewer_api, pd_pools, v2):
    assert viewer_api.post("/api/v1/rollouts/", _body(pd_pools, v2), format="json").status_code == 403


STATE_READ_ONLY = ("Read-only: state is the controller's; drive the rollout with POST /api/v1/rollouts/{id}/"
                   "start|pause|resume|promote|abort|rollback/.")


def test_rollout_writes_refuse_unknown_and_read_only_fields_and_change_nothing(operator_api, pd_pools, v2):
    """A misspelt or read-only field was dropped: the plan was created without it (or changed without it)."""
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, state="progressing", auto_promote=True),
                          format="json")
    assert (r.status_code, r.json()) == (400, {"state": [STATE_READ_ONLY],
                                               "auto_promote": ["Unknown field: it is not part of this resource."]})
    r = operator_api.post("/api/v1/rollouts/validate/", _body(pd_pools, v2, router_url=None), format="json")
    assert (r.status_code, list(r.json())) == (400, ["router_url"])
    assert RolloutPlan.objects.count() == 0
    pk = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2), format="json").json()["id"]
    r = operator_api.patch(f"/api/v1/rollouts/{pk}/", {"steps": [{"set_weight": 25}], "stratgy": "blue_green"},
                           format="json")
    assert (r.status_code, list(r.json())) == (400, ["stratgy"])
    assert RolloutPlan.objects.get().steps == STEPS


def test_a_verb_without_options_refuses_a_body_field_and_does_nothing(operator_api, pd_pools, v2):
    """``POST .../start/ {"dry_run": true}`` started the rollout for real."""
    pk = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2), format="json").json()["id"]
    r = operator_api.post(f"/api/v1/rollouts/{pk}/start/", {"dry_run": True}, format="json")
    assert (r.status_code, r.json()) == (400, {"dry_run": [
        "Unknown field: this request takes no fields (send no body or {})."]})
    assert RolloutPlan.objects.get().state == "pending"
    assert operator_api.post(f"/api/v1/rollouts/{pk}/start/", {}, format="json").status_code == 200
    assert RolloutPlan.objects.get().state != "pending"


def test_rollouts_pick_a_registered_router_and_refuse_a_free_text_router_url(operator_api, admin_api, pd_pools, v2,
                                                                            make_cluster):
    """SSRF (issue 19): a rollout names a router of the admin's registry; router_url is refused, not fetched."""
    for url in ("http://169.254.169.254", "file:///etc/passwd", "gopher://x:70/", "junk"):
        r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, router_url=url), format="json")
        assert (r.status_code, list(r.json())) == (400, ["router_url"])
    # the registry is admin-only and validates URLs
    cluster = pd_pools[0].cluster
    assert operator_api.post("/api/v1/routers/", {"name": "r1", "cluster": cluster.pk, "url": "http://r1.example:8080"},
                             format="json").status_code == 403
    bad = admin_api.post("/api/v1/routers/", {"name": "r0", "cluster": cluster.pk, "url": "file:///etc/passwd"},
                         format="json")
    assert (bad.status_code, list(bad.json())) == (400, ["url"])
    router = admin_api.post("/api/v1/routers/", {"name": "r1", "cluster": cluster.pk, "url": "http://r1.example:8080"},
                            format="json").json()
    elsewhere = admin_api.post("/api/v1/routers/", {"name": "r2", "cluster": make_cluster("dc-z").pk,
                                                    "url": "http://r2.example:8080"}, format="json").json()
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, router=elsewhere["id"]), format="json")
    assert (r.status_code, list(r.json())) == (400, ["router"])
    r = operator_api.post("/api/v1/rollouts/", _body(pd_pools, v2, router=router["id"]), format="json")
    assert r.status_code == 201, r.json()
    assert (r.json()["router"], r.json()["router_url"]) == (router["id"], "http://r1.example:8080")
