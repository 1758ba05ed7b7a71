"""``/api/v1/profiles/`` and ``/api/v1/plans/``: roles, 400s naming the field, apply and measured, the schema."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from apps.operations.models import Action
from apps.operations.pools import pool_scale
from apps.planning.models import PlanResult, PlanScenario, Profile
from apps.planning.tests.conftest import FIXTURES, WORKLOAD

pytestmark = pytest.mark.django_db


def _plan_body(two_dcs, **changes):
    return {"prefill_pool": two_dcs["prefill"].pk, "decode_pool": two_dcs["decode"].pk, "link": two_dcs["link"].pk,
            "workload": dict(WORKLOAD), **changes}


def test_viewers_read_and_operators_write(two_dcs, profiles, viewer_api, operator_api):
    listed = viewer_api.get("/api/v1/profiles/")
    assert listed.status_code == 200 and [p["id"] for p in listed.json()["results"]] == [profiles[1].pk,
                                                                                       profiles[0].pk]
    profile = json.loads((FIXTURES / "prefill_profile.json").read_text())
    refused = viewer_api.post("/api/v1/profiles/", {"pool": two_dcs["prefill"].pk, "profile": profile}, format="json")
    assert refused.status_code == 403 and "needs the operator role" in refused.json()["detail"]
    assert viewer_api.post("/api/v1/plans/", _plan_body(two_dcs), format="json").status_code == 403
    created = operator_api.post("/api/v1/profiles/", {"pool": two_dcs["prefill"].pk, "profile": profile},
                                format="json")
    assert created.status_code == 201
    assert created.json()["prefill_coefficients"] == pytest.approx([0.02, 0.0005, 0.0], abs=1e-12)
    assert created.json()["source"] == "imported" and created.json()["pool_kind"] == "prefill"
    assert created.json()["model_version_label"] == "gemma-like:v1"


def test_plan_create_apply_and_measured(two_dcs, profiles, operator_api, viewer_api, default_history):
    created = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, name="peak"), format="json")
    assert created.status_code == 201, created.json()
    plan = created.json()
    assert (plan["name"], plan["prefill_replicas"], plan["decode_replicas"], plan["threshold_tokens"]) == (
        "peak", 1, 1, 9)
    assert plan["applied"] == [] and plan["applied_at"] is None
    applied = operator_api.post(f"/api/v1/plans/{plan['id']}/apply/")
    assert applied.status_code == 200
    steps = applied.json()["applied"]
    assert [(s["step"], s["pool"], s.get("replicas")) for s in steps] == [
        ("scale", two_dcs["prefill"].pk, 1), ("scale", two_dcs["decode"].pk, 1), ("set_bounds", two_dcs["decode"].pk, None)]
    assert sorted(Action.objects.filter(kind="pool.scale").values_list("params__replicas", flat=True)) == [1, 1]
    measured = viewer_api.get(f"/api/v1/plans/{plan['id']}/measured/")
    assert measured.status_code == 200
    assert measured.json() == {
        "predicted": {"ttft_p50_s": plan["ttft_p50_s"], "ttft_p90_s": plan["ttft_p90_s"], "tpot_s": plan["tpot_s"]},
        "measured": {str(pid): {"at": None, "since": None, "records": 0, "ttft_p50_s": None, "ttft_p95_s": None,
                                "tpot_p50_s": None, "request_rate_per_s": None}
                     for pid in (two_dcs["prefill"].pk, two_dcs["decode"].pk)}}


def test_apply_on_a_busy_pool_is_409(two_dcs, profiles, operator_api):
    plan = operator_api.post("/api/v1/plans/", _plan_body(two_dcs), format="json").json()
    pool_scale(pool=two_dcs["prefill"], replicas=2)
    refused = operator_api.post(f"/api/v1/plans/{plan['id']}/apply/")
    assert refused.status_code == 409 and "already has action" in refused.json()["detail"]
    assert Action.objects.count() == 1


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"extra": 1}, "extra", "Unknown field"),
    ({"workload": {**WORKLOAD, "rate_per_s": True}}, "workload", "A valid number is required."),
    ({"workload": {k: v for k, v in WORKLOAD.items() if k != "rate_per_s"}}, "workload",
     "This field is required unless workload_source is telemetry."),
    ({"workload": {**WORKLOAD, "prompt_p90": 100}}, "workload", "must be at least prompt_median"),
    ({"workload": {**WORKLOAD, "prompt_cap": 512}}, "workload", "must be at least prompt_median and prompt_p90"),
    ({"workload": {**WORKLOAD, "attainment": 1.5}}, "workload", "less than or equal to 0.999"),
    ({"workload": {**WORKLOAD, "unknown": 1}}, "workload", "Unknown field"),
    ({"workload": "fast"}, "workload", "Expected a dictionary"),
    ({"workload_source": "yesterday"}, "workload_source", "not a valid choice"),
    ({"max_replicas": 1}, "max_replicas", "greater than or equal to 2"),
    ({"link": 999999}, "link", "does not exist"),
])
def test_bad_plan_input_is_a_400_naming_the_field(two_dcs, profiles, operator_api, change, field, message):
    refused = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, **change), format="json")
    assert refused.status_code == 400, refused.json()
    assert message in json.dumps(refused.json()[field])
    assert not PlanResult.objects.exists()


def test_every_wrong_field_is_named_in_one_answer(two_dcs, profiles, operator_api):
    """A client learns every mistake at once: an unknown field, a missing pool, the workload's missing, unknown and
    malformed fields (the given source's required ones too), not one round per kind."""
    body = _plan_body(two_dcs, extra=1, workload={"prompt_median": "many", "typo": 1})
    del body["prefill_pool"]
    refused = operator_api.post("/api/v1/plans/", body, format="json")
    assert refused.status_code == 400
    errors = refused.json()
    assert sorted(errors) == ["extra", "prefill_pool", "workload"]
    assert errors["prefill_pool"] == ["This field is required."]
    assert errors["workload"] == {
        "typo": ["Unknown field: it is not part of this resource."],
        "prompt_median": ["A valid integer is required."],
        "ttft_slo_s": ["This field is required."], "tpot_slo_s": ["This field is required."],
        **{f: ["This field is required unless workload_source is telemetry."]
           for f in ("prompt_cap", "output_median", "rate_per_s")}}
    both = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, decode_pool=two_dcs["prefill"].pk, bogus=1,
                                                          workload={**WORKLOAD, "prompt_cap": 50, "zzz": 1}),
                             format="json")
    assert both.status_code == 400
    assert both.json() == {"bogus": ["Unknown field: it is not part of this resource."],
                           "decode_pool": ["choose two different pools"],
                           "workload": {"zzz": ["Unknown field: it is not part of this resource."],
                                        "prompt_cap": ["must be at least prompt_median and prompt_p90"]}}
    telemetry = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, workload_source="telemetry", workload={}),
                                  format="json")
    assert telemetry.status_code == 400
    assert telemetry.json() == {"workload": {"ttft_slo_s": ["This field is required."],
                                             "tpot_slo_s": ["This field is required."]}}
    assert not PlanResult.objects.exists()


def test_given_fields_with_the_telemetry_source_are_refused_by_name(two_dcs, profiles, operator_api):
    """Telemetry gives the lengths, the rate and the cached prefix: values sent beside it would be dropped unseen."""
    refused = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, workload_source="telemetry", workload={
        "ttft_slo_s": 2, "tpot_slo_s": 0.5, "prompt_median": 100, "rate_per_s": 0.5, "cached_prefix_mean": 50}),
        format="json")
    assert refused.status_code == 400
    assert sorted(refused.json()["workload"]) == ["cached_prefix_mean", "prompt_median", "rate_per_s"]
    assert "leave it out, or use workload_source given" in refused.json()["workload"]["rate_per_s"][0]


def test_a_form_post_with_the_csrf_token_is_not_an_unknown_field(two_dcs, operator_api):
    made = operator_api.post("/api/v1/profiles/measure/", {"pool": two_dcs["decode"].pk, "hardware_label": "cpu",
                                                           "csrfmiddlewaretoken": "x"}, format="multipart")
    assert made.status_code == 201, made.json()
    assert made.json()["kind"] == "pool.profile"


def test_swapped_pool_roles_are_refused(two_dcs, profiles, operator_api):
    swapped = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, prefill_pool=two_dcs["decode"].pk,
                                                             decode_pool=two_dcs["prefill"].pk), format="json")
    assert swapped.status_code == 400
    assert "is a decode pool" in swapped.json()["prefill_pool"][0]


def test_the_schema_documents_the_plan_workload(viewer_api):
    schema = viewer_api.get("/api/v1/schema/?format=json").json()
    props = schema["components"]["schemas"]["PlanCreateRequest"]["properties"]
    assert json.dumps(props["workload"]).count("#/components/schemas/WorkloadRequest") == 1
    workload = schema["components"]["schemas"]["WorkloadRequest"]
    assert workload["required"] == ["tpot_slo_s", "ttft_slo_s"]
    assert set(workload["properties"]) == {
        "prompt_median", "prompt_p90", "prompt_cap", "output_median", "rate_per_s", "ttft_slo_s", "tpot_slo_s",
        "attainment", "max_link_share", "cached_prefix_mean"}


def test_deleting_a_plan_frees_its_profiles(two_dcs, profiles, operator_api, viewer_api):
    plan = operator_api.post("/api/v1/plans/", _plan_body(two_dcs), format="json").json()
    operator_api.post(f"/api/v1/plans/{plan['id']}/apply/")
    kept = operator_api.delete(f"/api/v1/profiles/{profiles[0].pk}/")
    assert kept.status_code == 409 and f"plan result #{plan['id']} of" in kept.json()["detail"]
    assert viewer_api.delete(f"/api/v1/plans/{plan['id']}/").status_code == 403
    assert operator_api.delete(f"/api/v1/plans/{plan['id']}/").status_code == 204
    assert not PlanResult.objects.exists() and not PlanScenario.objects.exists()
    assert Action.objects.filter(kind="pool.scale").count() == 2
    assert operator_api.delete(f"/api/v1/profiles/{profiles[0].pk}/").status_code == 204
    assert operator_api.delete(f"/api/v1/plans/{plan['id']}/").status_code == 404
    assert operator_api.post(f"/api/v1/plans/{plan['id']}/apply/").status_code == 404


def test_applying_a_plan_deleted_meanwhile_scales_nothing(two_dcs, profiles):
    """The apply's view read the plan, then a concurrent DELETE removed it: the apply refuses, creating nothing."""
    from apps.planning import services

    plan = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                                workload=dict(WORKLOAD))
    stale = PlanResult.objects.get(pk=plan.pk)
    services.plan_delete(result=plan)
    with pytest.raises(services.PlanGone, match=f"plan #{plan.pk} was deleted"):
        services.plan_apply(result=stale)
    assert not Action.objects.exists()


def test_same_pool_twice_no_profile_and_unmeetable_objectives_are_400s(two_dcs, operator_api):
    same = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, decode_pool=two_dcs["prefill"].pk), format="json")
    assert same.status_code == 400 and same.json()["decode_pool"] == ["choose two different pools"]
    missing = operator_api.post("/api/v1/plans/", _plan_body(two_dcs), format="json")
    assert missing.status_code == 400 and "no profile for pool dc-p/prefill" in missing.json()["prefill_pool"][0]
    for pool, name in ((two_dcs["prefill"], "prefill_profile.json"), (two_dcs["decode"], "decode_profile.json")):
        operator_api.post("/api/v1/profiles/", {"pool": pool.pk, "profile": json.loads((FIXTURES / name).read_text())},
                          format="json")
    hopeless = operator_api.post("/api/v1/plans/", _plan_body(two_dcs, workload={**WORKLOAD, "ttft_slo_s": 0.01}),
                                 format="json")
    assert hopeless.status_code == 400 and hopeless.json()["workload"] == [
        "a prompt of 1024 tokens (the p90 prompt) takes 0.532 s to prefill on the faster pool's profile, alone: over "
        "the TTFT objective of 0.01 s at any number of replicas; relax the TTFT objective, shorten the prompts or "
        "profile faster hardware"]


@pytest.mark.parametrize(("profile", "field", "message"), [
    ("not an object", "file", "expected a JSON object"),
    ({"hardware_label": "x", "prefill_points": [[64, "fast"]], "decode_points": []}, "prefill_points",
     "expected [x, seconds] (two numbers)"),
    ({"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], [2, 0.2]],
      "kv_capacity_bytes": -5}, "kv_capacity_bytes", "a positive whole number of bytes"),
])
def test_a_malformed_profile_is_a_400_naming_the_field(two_dcs, operator_api, profile, field, message):
    refused = operator_api.post("/api/v1/profiles/", {"pool": two_dcs["decode"].pk, "profile": profile}, format="json")
    assert refused.status_code == 400
    assert message in json.dumps(refused.json()[field])
    assert not Profile.objects.exists()


def test_measure_requests_a_pool_profile_action(two_dcs, operator_api):
    made = operator_api.post("/api/v1/profiles/measure/", {"pool": two_dcs["decode"].pk, "hardware_label": "cpu",
                                                           "lengths": [16, 32, 64], "batch_sizes": [1, 2]},
                             format="json")
    assert made.status_code == 201
    assert (made.json()["kind"], made.json()["params"]) == ("pool.profile", {
        "hardware_label": "cpu", "lengths": [16, 32, 64], "batch_sizes": [1, 2], "max_new_tokens": 12})
    short = operator_api.post("/api/v1/profiles/measure/", {"pool": two_dcs["prefill"].pk, "hardware_label": "cpu",
                                                            "lengths": [16, 32]}, format="json")
    assert short.status_code == 400 and "at least 3" in json.dumps(short.json()["lengths"])
    busy = operator_api.post("/api/v1/profiles/measure/", {"pool": two_dcs["decode"].pk, "hardware_label": "cpu"},
                             format="json")
    assert busy.status_code == 409


def test_the_schema_documents_the_planning_endpoints(viewer_api):
    schema = viewer_api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = json.loads(schema.content)["paths"]
    for path in ("/api/v1/profiles/", "/api/v1/profiles/measure/", "/api/v1/plans/", "/api/v1/plans/{id}/apply/",
                 "/api/v1/plans/{id}/measured/"):
        assert path in paths
    assert "PlanCreate" in json.dumps(paths["/api/v1/plans/"]["post"])


@pytest.mark.parametrize("value", ["9223372036854775808", "-4.2e19", "x"])
def test_plan_pool_filter_refuses_what_no_pool_id_can_be(viewer_api, value):
    refused = viewer_api.get(f"/api/v1/plans/?pool={value}")
    assert refused.status_code == 400 and "pool" in refused.json()


def test_plan_pool_filter_finds_plans_of_either_pool(two_dcs, profiles, operator_api, make_pool):
    plan = operator_api.post("/api/v1/plans/", _plan_body(two_dcs), format="json").json()
    for pool, expected in ((two_dcs["prefill"], [plan["id"]]), (two_dcs["decode"], [plan["id"]]),
                           (make_pool("other", role="decode", replicas=0), [])):
        found = operator_api.get(f"/api/v1/plans/?pool={pool.pk}")
        assert [p["id"] for p in found.json()["results"]] == expected


def test_measured_is_each_pools_telemetry_since_the_apply_weighted_by_request_rate(two_dcs, profiles, operator_api,
                                                                                   default_history):
    """Before the apply the last 5 minutes count; after it only the records since. Latencies weigh by the request
    rate of their window (an idle window's empty quantile counts for nothing), the rate is the plain mean."""
    from apps.telemetry.selectors import history_scope

    plan = operator_api.post("/api/v1/plans/", _plan_body(two_dcs), format="json").json()
    now = time.time()
    for age, rate, ttft in ((400, 9.0, 9.0), (200, 1.0, 0.5), (100, 3.0, 0.25), (50, 0.0, None)):
        default_history.append(history_scope(two_dcs["decode"].pk), now - age, {
            "at": now - age, "signals": {"ttft_p50_s": ttft, "ttft_p95_s": ttft and 3 * ttft, "tpot_p50_s": 0.03,
                                         "request_rate_per_s": rate, "error_rate": 0.0}})
    measured = operator_api.get(f"/api/v1/plans/{plan['id']}/measured/").json()["measured"]
    # the record 400 s old is outside the 5 minutes; p50 (1 x 0.5 + 3 x 0.25) / 4, rate (1 + 3 + 0) / 3
    assert measured[str(two_dcs["decode"].pk)] == {
        "at": pytest.approx(now - 50), "since": pytest.approx(now - 200), "records": 3,
        "ttft_p50_s": pytest.approx(0.3125), "ttft_p95_s": pytest.approx(0.9375), "tpot_p50_s": pytest.approx(0.03),
        "request_rate_per_s": pytest.approx(4 / 3)}
    assert measured[str(two_dcs["prefill"].pk)] == {"at": None, "since": None, "records": 0, "ttft_p50_s": None,
                                                    "ttft_p95_s": None, "tpot_p50_s": None, "request_rate_per_s": None}
    PlanResult.objects.filter(pk=plan["id"]).update(applied_at=datetime.fromtimestamp(now - 150, tz=UTC))
    measured = operator_api.get(f"/api/v1/plans/{plan['id']}/measured/").json()["measured"]
    assert (measured[str(two_dcs["decode"].pk)]["records"], measured[str(two_dcs["decode"].pk)]["ttft_p50_s"]) == (
        2, pytest.approx(0.25))


@pytest.mark.parametrize(("points", "message"), [
    ({"prefill_points": [[64, 0.1], [128, 0.2], [1e300, 0.3]]},
     "item 2: x must be a positive whole number at most 1000000, got 1e+300"),
    ({"decode_points": [[1, 0.1], [10 ** 400, 0.2]]}, "item 1: x must be a positive whole number at most 1000000"),
    ({"prefill_points": [[64, 1.0], [256, 0.5], [512, 0.1], [1024, 0.01]]}, "must grow with the prompt length"),
])
def test_an_out_of_range_profile_is_a_400_naming_the_points(two_dcs, operator_api, points, message):
    profile = {**json.loads((FIXTURES / "prefill_profile.json").read_text()), **points}
    refused = operator_api.post("/api/v1/profiles/", {"pool": two_dcs["prefill"].pk, "profile": profile}, format="json")
    assert refused.status_code == 400
    field, = points
    assert message in refused.json()[field][0]
    assert not Profile.objects.exists()


@pytest.mark.parametrize(("value", "kind"), [("1.5", "float"), ("1e400", "float"), ("true", "bool"), ('"1.5"', "str"),
                                           ('"1e400"', "str"), ("[1]", "list"), ("null", None)])
def test_an_id_that_is_not_a_whole_number_is_a_400(two_dcs, profiles, operator_api, admin_api, value, kind):
    """Regression: ``{"pool": 1.5}`` profiled pool 1 (DRF's relation field passed 1.5 to the lookup), ``1e400`` was a
    500 (OverflowError). A string of digits is still an id. A ModelSerializer's generated relation (a pool's
    cluster) refuses the same."""
    def post(client, url, body: dict, field: str):
        text = json.dumps({**body, field: "VALUE"}).replace('"VALUE"', value)
        return client.generic("POST", url, text, content_type="application/json")

    measured = post(operator_api, "/api/v1/profiles/measure/", {"hardware_label": "cpu"}, "pool")
    planned = post(operator_api, "/api/v1/plans/", _plan_body(two_dcs), "prefill_pool")
    created = post(admin_api, "/api/v1/pools/", {"name": "p9", "role": "decode",
                                                 "model_version": two_dcs["decode"].model_version_id}, "cluster")
    expected = (f"Incorrect type. Expected pk value, received {kind}." if kind else "This field may not be null.")
    for answer, field in ((measured, "pool"), (planned, "prefill_pool"), (created, "cluster")):
        assert answer.status_code == 400, (field, answer.status_code, answer.content[:200])
        assert answer.json()[field] == [expected], answer.json()
    assert Action.objects.filter(kind="pool.profile").count() == 0
    assert operator_api.post("/api/v1/profiles/measure/", {"pool": str(two_dcs["prefill"].pk), "hardware_label": "cpu"},
                             format="json").status_code == 201
