"""Planning services: profiles fitted from points, a plan from the profile fixtures (exact numbers), apply as
Actions, the profiling Action's failures, and the telemetry workload."""

from __future__ import annotations

import io
import math
import time

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from apps.core.errors import ConflictError
from apps.operations.execution import action_execute
from apps.operations.models import Action
from apps.operations.pools import pool_scale
from apps.planning import selectors, services
from apps.planning.models import PlanResult, Profile
from apps.planning.recommend import FittedReplicaProfile, Workload
from apps.planning.tests.conftest import FIXTURES, WORKLOAD
from inference_worker.planning.geometry import KVGeometry
from inference_worker.planning.planner import latency_threshold

pytestmark = pytest.mark.django_db


def test_import_fits_the_fixture_points_exactly(profiles):
    prefill, decode = profiles
    assert (prefill.source, prefill.hardware_label, prefill.pool_kind, decode.pool_kind) == (
        "imported", "cpu-2core", "prefill", "decode")
    assert prefill.prefill_points == [[64, 0.052], [256, 0.148], [512, 0.276], [1024, 0.532]]
    # The points lie on t = 0.02 + 0.0005 N (prefill pool), t = 0.03 + 0.001 N (decode pool), t = 0.02 + 0.005 B.
    assert prefill.prefill_coefficients == pytest.approx([0.02, 0.0005, 0.0], abs=1e-12)
    assert decode.prefill_coefficients == pytest.approx([0.03, 0.001, 0.0], abs=1e-12)
    assert decode.decode_coefficients == pytest.approx([0.02, 0.005], abs=1e-12)
    assert prefill.kv_capacity_bytes is None
    assert prefill.colocated_prefill_points == [] and selectors.fitted(prefill).colocated_overhead_s is None


def test_a_plan_reaching_past_where_a_fit_stays_positive_is_refused_naming_the_pool(two_dcs, profiles):
    # Concave through 64..512 tokens (0.1, 0.286, 0.3 s): positive there, negative before the workload's cap of
    # 2048 tokens, where the planner would read a negative prefill time.
    text = ('{"hardware_label": "cpu-2core", "prefill_points": [[64, 0.1], [256, 0.286], [512, 0.3]], '
            '"decode_points": [[1, 0.025], [2, 0.03]]}')
    concave = services.profile_import(pool=two_dcs["decode"], text=text)
    with pytest.raises(ValidationError) as refused:
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                             workload=WORKLOAD, max_replicas=16)
    assert refused.value.message_dict == {"decode_pool": [
        f"profile #{concave.pk}: the fitted prefill time is not positive for some prompt of 1 to 2048 tokens (the "
        "workload's cap); measure prompts up to that length or lower prompt_cap"]}
    assert not PlanResult.objects.exists()


def test_import_with_colocated_prefill_points_fits_them(two_dcs):
    # Prefill while decoding: t = 0.1 + 0.001 N (the decode pool's own prefill 0.03 + 0.001 N, plus 70 ms).
    text = ('{"hardware_label": "cpu-2core", "prefill_points": [[64, 0.094], [256, 0.286], [512, 0.542]], '
            '"decode_points": [[1, 0.025], [2, 0.03]], '
            '"colocated_prefill_points": [[64, 0.164], [256, 0.356], [512, 0.612]]}')
    profile = services.profile_import(pool=two_dcs["decode"], text=text)
    profile.refresh_from_db()
    assert profile.colocated_prefill_points == [[64, 0.164], [256, 0.356], [512, 0.612]]
    fitted = selectors.fitted(profile)
    # The decode pool's own prefill fits 0.03 + 0.001 N: every co-located point is 70 ms above it.
    assert fitted.colocated_overhead_s == pytest.approx(0.07, abs=1e-9)
    assert fitted.colocated_prefill_time_s(300) == pytest.approx(0.4, rel=1e-9)


@pytest.mark.parametrize(("text", "field", "message"), [
    ("{not json", "file", "not valid JSON"),
    ("[1, 2]", "file", "expected a JSON object"),
    ('{"hardware_label": "x", "prefill_points": [[1, 1]], "decode_points": [[1, 1]], "extra": 1}', "file",
     "unknown keys ['extra']"),
    ('{"prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "hardware_label", "non-empty string"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.1], [128, 0.2]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "at least 3 distinct prompt lengths"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.1], [128, 0.2], [256, -1]], "decode_points": [[1, 0.1]]}',
     "prefill_points", "item 2: seconds must be a positive finite number"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.2], [2, 0.1]]}',
     "decode_points", "must have a positive intercept and slope"),
    ('{"hardware_label": "x", "prefill_points": [[64.5, 0.1], [128, 0.2], [256, 0.3]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "item 0: x must be a positive whole number"),
    ('{"hardware_label": "x", "source": "measured", "prefill_points": [], "decode_points": []}', "source",
     "'imported' or 'roofline'"),
    # Out-of-range numbers (a file may hold NaN and Infinity; huge x overflowed or broke the least-squares fit).
    ('{"hardware_label": "x", "prefill_points": [[NaN, 0.1], [128, 0.2], [256, 0.3]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "item 0: x must be a positive whole number at most 1000000, got nan"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.1], [128, 0.2], [Infinity, 0.3]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "item 2: x must be a positive whole number at most 1000000, got inf"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.1], [128, 0.2], [1e300, 0.3]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "item 2: x must be a positive whole number at most 1000000, got 1e+300"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], [1' + "0" * 400
     + ', 0.2]]}', "decode_points", "item 1: x must be a positive whole number at most 1000000, got 1000"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.1], [128, 0.2], [256, 1e308]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "item 2: seconds must be a positive finite number at most 3600, got 1e+308"),
    # A prefill that is fitted faster for longer prompts is not a measurement of one.
    ('{"hardware_label": "x", "prefill_points": [[64, 1.0], [256, 0.5], [512, 0.1], [1024, 0.01]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "must grow with the prompt length over the measured lengths 64..1024"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.5], [128, 0.5], [256, 0.5]], "decode_points": [[1, 0.1], [2, 0.2]]}',
     "prefill_points", "must grow with the prompt length over the measured lengths 64..256"),
    # Concave through its points, it would prefill prompts of under 15 tokens in negative time.
    ('{"hardware_label": "x", "prefill_points": [[64, 0.1], [128, 0.2], [256, 0.3]], "decode_points": [[1, 0.1], [2, '
     '0.15]]}', "prefill_points", "stay positive from 1 token to 256"),
    # Falsy values that are not a list are not "not measured".
    ('{"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], '
     '[2, 0.15]], "colocated_prefill_points": false}', "colocated_prefill_points", "give a list of 1 to 64"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], '
     '[2, 0.15]], "colocated_prefill_points": {}}', "colocated_prefill_points", "give a list of 1 to 64"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], '
     '[2, 0.15]], "colocated_prefill_points": 0}', "colocated_prefill_points", "give a list of 1 to 64"),
    ("[" * 100_000 + "]" * 100_000, "file", "nests too deeply"),
    ('{"hardware_label": "' + "h" * 101 + '", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], [2, 0.15]]}',
     "hardware_label", "at most 100 characters (it has 101)"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], [2, '
     '0.15]], "colocated_prefill_points": [[64, 0.2], [128, -0.3]]}',
     "colocated_prefill_points", "item 1: seconds must be a positive finite number"),
    ('{"hardware_label": "x", "prefill_points": [[64, 0.15], [128, 0.25], [256, 0.45]], "decode_points": [[1, 0.1], [2, '
     '0.15]], "colocated_prefill_points": [[64, 0.2], [128, "slow"], [256, 0.4]]}',
     "colocated_prefill_points", "item 1"),
])
def test_a_malformed_profile_file_is_refused_naming_the_field(two_dcs, text, field, message):
    with pytest.raises(ValidationError) as refused:
        services.profile_import(pool=two_dcs["prefill"], text=text)
    assert message in " ".join(refused.value.message_dict[field])
    assert not Profile.objects.exists()


def test_plan_from_the_fixture_profiles_is_exact(two_dcs, profiles):
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=WORKLOAD, max_replicas=16)
    # The threshold is the router's PD cost function fed with both fits' speeds at the median (256 tokens):
    # 256 / 0.148 s (prefill pool) and 256 / 0.286 s (decode pool), 10 Gbit/s, 5 ms.
    geometry = KVGeometry(two_dcs["decode"].model_version.model_config())
    assert result.threshold_tokens == latency_threshold(
        geometry, local_prefill_tokens_per_s=256 / 0.286, remote_prefill_tokens_per_s=256 / 0.148,
        bandwidth_gbps=10.0, rtt_s=0.005, max_tokens=2048) == 9
    # Smallest fleet: 1 remote prefill and 1 decode replica, which also prefills the 0.1% of prompts of <= 9 tokens
    # itself (co-located, as a Ferry decode replica does): 1 replica per pool.
    assert result.fleet == {"remote_prefill": 1, "local_prefill": 0, "decode": 1, "threshold_tokens": 9,
                            "colocated": True}
    assert (result.prefill_replicas, result.decode_replicas) == (1, 1)
    # TPOT by hand: a decoding sequence sees itself and B others, t_step = b0 + b1 (1 + B), B = x TPOT, x = rate *
    # output / decode replicas = 16 tokens/s: TPOT = (b0 + b1) / (1 - b1 x). The 0.001 req/s of local prompts
    # (their steps, about 45 ms each) lengthen it by about 1.5e-5 of itself.
    tpot = (0.02 + 0.005) / (1 - 0.005 * 16)
    assert result.tpot_s == pytest.approx(tpot, rel=1e-4) and result.tpot_s > tpot
    assert result.remote_share == pytest.approx(0.999, abs=1e-12)
    assert result.link_gbps == pytest.approx(0.0453961728, rel=1e-9)
    assert result.link_share == pytest.approx(0.00453961728, rel=1e-9)
    # A remotely prefilled request waits for the decode step in progress, p * t_step / 2 with p = 1 - exp(-B):
    # 4.79 ms over the 0.19986 s the median took with separate pools (the planner before co-location).
    wait = (1 - math.exp(-16 * tpot)) * tpot / 2
    assert wait == pytest.approx(0.0047907, abs=1e-7)
    assert (result.ttft_p50_s, result.ttft_p90_s) == (pytest.approx(0.19985814616660752 + wait, rel=1e-4),
                                                      pytest.approx(0.7413899274254889, rel=1e-6))
    assert result.attainment == pytest.approx(0.9989289148741161, rel=1e-9)
    assert [p["rate_per_s"] for p in result.curve] == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
    assert result.curve[3]["ttft_p90_s"] == pytest.approx(result.ttft_p90_s, rel=1e-12)
    assert result.scenario.workload == WORKLOAD and result.workload == WORKLOAD


def test_the_planning_pages_workload_is_met_on_the_demo_fleets_profile(two_dcs):
    """The page's starting workload gives a recommendation on the profile ``make run``'s CPU workers measured
    (session 9, quiet host); the workload it replaced (p90 1024, cap 2048 tokens, TPOT 0.1 s) is refused: its p90
    prompt alone takes longer than the TTFT objective."""
    text = (FIXTURES / "demo_cpu_profile.json").read_text()
    for pool in (two_dcs["prefill"], two_dcs["decode"]):
        services.profile_import(pool=pool, text=text)
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=dict(selectors.PAGE_WORKLOAD))
    assert (result.prefill_replicas, result.decode_replicas, result.threshold_tokens) == (0, 2, None)
    assert result.ttft_p90_s <= selectors.PAGE_WORKLOAD["ttft_slo_s"]
    assert result.tpot_s <= selectors.PAGE_WORKLOAD["tpot_slo_s"]
    # The old default: its p90 prompt alone takes longer than the TTFT objective to prefill.
    with pytest.raises(ValidationError, match=r"a prompt of 1024 tokens \(the p90 prompt\) takes 3.05 s"):
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                             workload={**selectors.PAGE_WORKLOAD, "prompt_p90": 1024, "prompt_cap": 2048,
                                       "rate_per_s": 1.0, "tpot_slo_s": 0.1})
    # A cached prefix is attended to: 1.06 s for the p90 prompt alone, 1.34 s after 600 cached tokens, 2.1 s
    # after 2200 (2 a2 N C with a2 = 6.03e-7 s).
    with pytest.raises(ValidationError, match=r"a prompt of 384 tokens after 2200 cached \(the p90 prompt\) takes 2.08 s"):
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                             workload={**selectors.PAGE_WORKLOAD, "cached_prefix_mean": 2200})


def test_a_cached_prefix_adds_the_attention_pairs_of_the_computed_tokens():
    """``t(N) + 2 a2 N C`` is ``t(N + C) - t(C) + a0``: the computed tokens' time after a cached prefix; a concave
    fit adds nothing, and a negative or infinite prefix is refused."""
    # The demo decode worker's sweep of session 10; the prefix measurement was on that worker.
    fitted = services.profile_fit(prefill_points=[[32, 0.1862], [128, 0.4174], [256, 0.7349], [512, 1.5509]],
                                  decode_points=[[1, 0.0804], [2, 0.1097], [3, 0.1332]])
    a0, _, a2 = fitted.prefill_coefficients
    assert a2 > 0
    cached = FittedReplicaProfile(fitted, 1e6, cached_prefix_tokens=592.0)
    for n in (1, 190, 512):
        assert cached.prefill_time_s(n) == pytest.approx(
            fitted.prefill_time_s(n + 592) - fitted.prefill_time_s(592) + a0, rel=1e-12)
        assert cached.colocated_prefill_time_s(n) - fitted.colocated_prefill_time_s(n) == pytest.approx(
            2 * a2 * n * 592, rel=1e-12)
    # Measured on that worker: 190 tokens after 592 cached took 0.20 s more than fresh. The sweep's a2 is noisy
    # (4 lengths up to 512): this fit says 0.33 s, session 9's sweep 0.14 s.
    assert 0.1 < cached.prefill_time_s(190) - fitted.prefill_time_s(190) < 0.4
    concave = services.profile_fit(prefill_points=[[32, 0.2], [128, 0.5], [256, 0.85], [512, 1.5]],
                                   decode_points=[[1, 0.08], [2, 0.11]])
    assert concave.prefill_coefficients[2] < 0
    assert FittedReplicaProfile(concave, 1e6, 592.0).prefill_time_s(100) == concave.prefill_time_s(100)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="cached_prefix_mean"):
            Workload(**{**WORKLOAD, "cached_prefix_mean": bad})


def test_apply_requests_one_scale_action_per_pool_and_records_why_bounds_were_skipped(two_dcs, profiles, operator_api):
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=WORKLOAD)
    steps = services.plan_apply(result=result, requested_by=operator_api.user)
    scale = Action.objects.filter(kind="pool.scale").order_by("id")
    assert [(a.pool_id, a.params, a.idempotency_key, a.status, a.requested_by) for a in scale] == [
        (two_dcs["prefill"].pk, {"replicas": 1}, f"plan-{result.pk}:scale-{two_dcs['prefill'].pk}", "pending",
         operator_api.user),
        (two_dcs["decode"].pk, {"replicas": 1}, f"plan-{result.pk}:scale-{two_dcs['decode'].pk}", "pending",
         operator_api.user)]
    assert steps[:2] == [
        {"step": "scale", "pool": two_dcs["prefill"].pk, "replicas": 1, "status": "requested", "action": scale[0].pk,
         "reason": ""},
        {"step": "scale", "pool": two_dcs["decode"].pk, "replicas": 1, "status": "requested", "action": scale[1].pk,
         "reason": ""}]
    assert services.threshold_bounds(9) == (4, 18)
    two_dcs["decode"].refresh_from_db()
    two_dcs["prefill"].refresh_from_db()
    assert (two_dcs["decode"].remote_threshold_min_tokens, two_dcs["decode"].remote_threshold_max_tokens) == (4, 18)
    assert (two_dcs["prefill"].remote_threshold_min_tokens, two_dcs["prefill"].remote_threshold_max_tokens) == (
        None, None)
    bounds_action = Action.objects.get(kind=services.POOL_SET_THRESHOLD_BOUNDS)
    assert steps[2] == {"step": "set_bounds", "pool": two_dcs["decode"].pk, "status": "done",
                        "action": bounds_action.pk, "reason": "", "bounds": [4, 18]}
    assert (bounds_action.status, bounds_action.params) == (
        "succeeded", {"remote_threshold_min_tokens": 4, "remote_threshold_max_tokens": 18})
    # Applying again changes nothing: the same steps, no new Action.
    assert services.plan_apply(result=PlanResult.objects.get(pk=result.pk)) == steps
    assert Action.objects.count() == len([s for s in steps if s["action"] is not None])


def test_two_applies_of_one_plan_apply_it_once(two_dcs, profiles):
    """Two requests that both read the plan before either applied it (concurrent applies): the second waits for the
    first and returns its steps; no second bounds Action, the first steps are kept."""
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=WORKLOAD)
    stale = PlanResult.objects.get(pk=result.pk)
    steps = services.plan_apply(result=result)
    assert services.plan_apply(result=stale) == steps
    assert sorted(Action.objects.values_list("kind", flat=True)) == [
        "pool.scale", "pool.scale", services.POOL_SET_THRESHOLD_BOUNDS]
    assert PlanResult.objects.get(pk=result.pk).applied == steps


def test_apply_to_a_busy_pool_creates_nothing(two_dcs, profiles):
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=WORKLOAD)
    busy, _ = pool_scale(pool=two_dcs["decode"], replicas=3)
    with pytest.raises(ConflictError, match="already has action"):
        services.plan_apply(result=result)
    assert list(Action.objects.values_list("id", flat=True)) == [busy.pk]
    result.refresh_from_db()
    assert (result.applied, result.applied_at) == ([], None)


def test_threshold_bounds_and_the_always_remote_plan(two_dcs, make_cluster):
    assert services.threshold_bounds(None) is None and services.threshold_bounds(0) is None
    assert services.threshold_bounds(-1) is None and services.threshold_bounds(1) == (0, 2)
    assert services.threshold_bounds(19) == (9, 38)
    services.profile_import(pool=two_dcs["prefill"], text=(FIXTURES / "prefill_profile.json").read_text())
    services.profile_import(pool=two_dcs["decode"], text=(FIXTURES / "decode_profile_slow_prefill.json").read_text())
    two_dcs["link"].rtt_ms = 1.0
    two_dcs["link"].save()
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=WORKLOAD)
    assert (result.threshold_tokens, result.prefill_replicas, result.decode_replicas, result.remote_share) == (0, 1, 1, 1.0)
    steps = services.plan_apply(result=result)
    assert steps[2] == {"step": "set_bounds", "pool": two_dcs["decode"].pk, "status": "skipped", "action": None,
                        "reason": "the plan prefills every prompt remotely"}


def test_an_always_remote_plan_clears_bounds_an_earlier_plan_left(two_dcs, profiles):
    """Bounds left by an earlier plan would steer the router against this one: applying it clears them."""
    from apps.fleet.services import pool_update

    pool_update(pool=two_dcs["decode"], remote_threshold_min_tokens=4, remote_threshold_max_tokens=18)
    services.profile_import(pool=two_dcs["decode"], text=(FIXTURES / "decode_profile_slow_prefill.json").read_text())
    two_dcs["link"].rtt_ms = 1.0
    two_dcs["link"].save()
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=WORKLOAD)
    assert result.threshold_tokens == 0
    step = services.plan_apply(result=result)[2]
    assert (step["status"], step["bounds"], step["reason"]) == (
        "done", [None, None], "the plan prefills every prompt remotely; cleared the earlier bounds")
    two_dcs["decode"].refresh_from_db()
    assert (two_dcs["decode"].remote_threshold_min_tokens, two_dcs["decode"].remote_threshold_max_tokens) == (None, None)
    assert Action.objects.get(pk=step["action"]).params == {"remote_threshold_min_tokens": None,
                                                           "remote_threshold_max_tokens": None}


def test_apply_says_when_a_fixed_threshold_overrides_the_bounds(two_dcs, profiles, settings):
    settings.FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS = 256
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=WORKLOAD)
    step = services.plan_apply(result=result)[2]
    assert step["status"] == "done" and step["warning"].startswith(
        "the routing table carries the fixed threshold FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS=256 (make run's demo "
        "sets it), which overrides the bounds")


def test_apply_says_where_long_prompts_go_when_the_plan_scales_prefill_to_0_under_a_fixed_threshold(two_dcs,
                                                                                                 settings):
    """The demo's fixed threshold keeps sending long prompts to the prefill pool a never-remote plan scales to 0:
    the warning says they fall back to a local prefill (seen by a new user after applying the page's plan)."""
    settings.FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS = 256
    text = (FIXTURES / "demo_cpu_profile.json").read_text()
    for pool in (two_dcs["prefill"], two_dcs["decode"]):
        services.profile_import(pool=pool, text=text)
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=dict(selectors.PAGE_WORKLOAD))
    assert (result.prefill_replicas, result.threshold_tokens) == (0, None)
    step = services.plan_apply(result=result)[2]
    assert step["warning"].endswith(
        "; meanwhile prompts over 256 tokens still go to the prefill pool, which this plan scales to 0: they are "
        "prefilled on the decode pool instead (router decision local_prefill_fallback)")


def test_a_plan_notes_replicas_that_would_share_a_local_clusters_machine(two_dcs):
    """Seen on make run: a plan of 2 decode replicas on the demo's 2-core machine predicted TTFT p50 0.34 s where
    0.62 s was measured; the plan now says its replicas would share the machine. A Kubernetes pool gets no note."""
    from apps.fleet.models import Cluster

    text = (FIXTURES / "demo_cpu_profile.json").read_text()
    for pool in (two_dcs["prefill"], two_dcs["decode"]):
        services.profile_import(pool=pool, text=text)
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"],
                                  link=two_dcs["link"], workload=dict(selectors.PAGE_WORKLOAD))
    assert (result.prefill_replicas, result.decode_replicas) == (0, 2)
    assert selectors.plan_notes(result=result) == [
        "dc-d/decode: its 2 replicas would be processes on the one machine of the local cluster dc-d, sharing its "
        "cores; the planner counts each at the profile's full speed, so there the prediction is optimistic"]
    Cluster.objects.filter(pk=two_dcs["decode"].cluster_id).update(kind="kubernetes")
    assert selectors.plan_notes(result=selectors.plan_list().get(pk=result.pk)) == []


def test_a_link_against_the_kv_flow_is_refused(two_dcs, profiles):
    from apps.fleet.services import cluster_link_create

    back = cluster_link_create(source=two_dcs["decode"].cluster, destination=two_dcs["prefill"].cluster,
                               bandwidth_gbps=10.0, rtt_ms=5.0)
    with pytest.raises(ValidationError, match="the KV cache flows the other way; choose the link dc-p -> dc-d"):
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=back,
                             workload=WORKLOAD)


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"rate_per_s": 1000.0}, "workload", "no fleet of at most 16 replicas meets TTFT p90 <= 2.0 s"),
    ({"rate_per_s": 1000.0, "attainment": 0.995}, "workload", "meets TTFT p99.5 <= 2.0 s"),
    ({"prompt_median": 1500, "prompt_p90": None, "prompt_cap": 2048, "rate_per_s": 0.01, "ttft_slo_s": 0.5},
     "workload", "a prompt of 1500 tokens (the p90 prompt) takes 0.77 s to prefill on the faster pool's profile, "
                 "alone: over the TTFT objective of 0.5 s at any number of replicas"),
    ({"prompt_p90": 100}, "workload", "need 1 <= median <= p90"),
    ({"cached_prefix_mean": 40000.0}, "workload", "prompts of up to 2048 tokens after 40000 cached (42048 in all) "
                                                  "exceed the model's context of 32768 tokens"),
    ({"prompt_cap": 1_000_000}, "workload", "prompts of up to 1000000 tokens (1000000 in all) exceed the model's "
                                            "context of 32768 tokens"),
])
def test_plan_errors_say_what_to_change(two_dcs, profiles, change, field, message):
    with pytest.raises(ValidationError) as refused:
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                             workload={**WORKLOAD, **change})
    assert message in " ".join(refused.value.message_dict[field])
    assert not PlanResult.objects.exists()


def test_plan_needs_a_profile_per_pool_and_a_link_joining_them(two_dcs, make_cluster):
    with pytest.raises(ValidationError) as refused:
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                             workload=WORKLOAD)
    assert "no profile for pool dc-p/prefill" in refused.value.message_dict["prefill_pool"][0]
    from apps.fleet.services import cluster_link_create

    other = cluster_link_create(source=two_dcs["decode"].cluster, destination=make_cluster("dc-x"), bandwidth_gbps=1.0,
                                rtt_ms=1.0)
    with pytest.raises(ValidationError) as refused:
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=other,
                             workload=WORKLOAD)
    assert "does not join the pools' clusters" in refused.value.message_dict["link"][0]


def test_a_pools_own_profile_wins_over_a_newer_sibling_one(two_dcs, make_pool, model_version):
    own = services.profile_import(pool=two_dcs["decode"], text=(FIXTURES / "decode_profile.json").read_text())
    sibling_pool = make_pool("decode-2", role="decode", replicas=0)
    sibling = services.profile_import(pool=sibling_pool, text=(FIXTURES / "decode_profile.json").read_text())
    from apps.planning.selectors import profile_for_pool

    assert profile_for_pool(pool=two_dcs["decode"]) == own
    assert profile_for_pool(pool=sibling_pool) == sibling
    assert profile_for_pool(pool=two_dcs["prefill"]) is None  # another role


def test_telemetry_workload_is_the_mean_of_the_recent_records(two_dcs, profiles, default_history):
    from apps.telemetry.selectors import history_scope

    now = time.time()
    for i, (rate, prompt, generation) in enumerate(((1.0, 280.0, 15.0), (3.0, 920.0, 65.0))):
        default_history.append(history_scope(two_dcs["decode"].pk), now - 10 + i, {
            "at": now - 10 + i, "signals": {"request_rate_per_s": rate, "prompt_tokens_per_s": prompt,
                                            "generation_tokens_per_s": generation}})
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                                  workload={"ttft_slo_s": 2.0, "tpot_slo_s": 0.1, "attainment": 0.9,
                                            "max_link_share": 1.0}, workload_source="telemetry")
    # mean rate 2 req/s, mean prompt 600 tokens/s / 2 = 300 tokens, output 40 / 2 = 20 tokens
    assert result.workload == {"ttft_slo_s": 2.0, "tpot_slo_s": 0.1, "attainment": 0.9, "max_link_share": 1.0,
                               "rate_per_s": 2.0, "prompt_median": 300, "prompt_p90": None, "prompt_cap": 300,
                               "output_median": 20, "cached_prefix_mean": 0.0}


def test_telemetry_workload_splits_prompts_by_the_prefix_cache_hit_rate(two_dcs, profiles, default_history):
    """A conversation's later turns find most of their prompt cached: the computed length is the rest."""
    from apps.telemetry.selectors import history_scope

    now = time.time()
    for i, hit in enumerate((0.7, 0.8)):
        default_history.append(history_scope(two_dcs["decode"].pk), now - 10 + i, {
            "at": now - 10 + i, "signals": {"request_rate_per_s": 2.0, "prompt_tokens_per_s": 1600.0,
                                            "generation_tokens_per_s": 32.0, "prefix_cache_hit_rate": hit}})
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                                  workload={"ttft_slo_s": 2.0, "tpot_slo_s": 0.1}, workload_source="telemetry")
    # 800 prompt tokens a request, 75% found cached: 200 computed after a 600-token prefix
    assert (result.workload["prompt_median"], result.workload["prompt_cap"]) == (200, 200)
    assert result.workload["cached_prefix_mean"] == pytest.approx(600.0)


def test_telemetry_workload_adds_the_prompt_tokens_the_prefill_pool_prefilled(two_dcs, profiles, default_history):
    """Regression: a decode pool counts only the prompt tokens prefilled on it; the long prompts the router sent
    to the prefill pool were missing, and the planner saw short prompts."""
    from apps.telemetry.selectors import history_scope

    now = time.time()
    default_history.append(history_scope(two_dcs["decode"].pk), now - 5, {"at": now - 5, "signals": {
        "request_rate_per_s": 2.0, "prompt_tokens_per_s": 200.0, "generation_tokens_per_s": 40.0,
        "prefix_cache_hit_rate": 0.0}})
    default_history.append(history_scope(two_dcs["prefill"].pk), now - 5, {"at": now - 5, "signals": {
        "request_rate_per_s": 1.0, "prompt_tokens_per_s": 1000.0, "prefix_cache_hit_rate": 0.4}})
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                                  workload={"ttft_slo_s": 2.0, "tpot_slo_s": 0.1}, workload_source="telemetry")
    # (200 + 1000) / 2 = 600 prompt tokens a request; hit rate (0 x 200 + 0.4 x 1000) / 1200 = 1/3: 400 computed
    assert {k: result.workload[k] for k in ("rate_per_s", "prompt_median", "prompt_p90", "prompt_cap",
                                            "output_median")} == {
        "rate_per_s": 2.0, "prompt_median": 400, "prompt_p90": None, "prompt_cap": 400, "output_median": 20}
    assert result.workload["cached_prefix_mean"] == pytest.approx(200.0)


def _length_record(rate: float, p50: float, p90: float, p99: float, prompt_mean: float, computed_mean: float,
                   output: float) -> dict:
    """Signals of one telemetry window with Ferry's request-length histograms (a decode pool)."""
    return {"request_rate_per_s": rate + 5.0,  # the requests counter counts profiling sweeps too: never read here
            "request_sequences_per_s": rate, "prompt_tokens_per_s": 1.0, "generation_tokens_per_s": 1.0,
            "request_computed_prompt_tokens_p50": p50, "request_computed_prompt_tokens_p90": p90,
            "request_computed_prompt_tokens_p99": p99, "request_prompt_tokens_mean": prompt_mean,
            "request_computed_prompt_tokens_mean": computed_mean, "request_generation_tokens_mean": output}


def test_telemetry_workload_reads_the_request_length_histograms(two_dcs, profiles, default_history):
    """Ferry workers' request-length histograms give the distribution: computed p50/p90 as median/p90 and the largest
    window p99 as the cap, the mean output, and mean prompt - mean computed as the cached prefix, windows weighing by
    their sequences answered per second (profiling sweeps are not among them)."""
    from apps.telemetry.selectors import history_scope

    now = time.time()
    for i, (rate, prompt_mean, computed_mean, output) in enumerate(((1.0, 500.0, 150.0, 16.0),
                                                                     (3.0, 700.0, 190.0, 20.0))):
        default_history.append(history_scope(two_dcs["decode"].pk), now - 10 + i, {
            "at": now - 10 + i, "signals": _length_record(rate, 100.0, 300.0, 700.0, prompt_mean, computed_mean,
                                                          output)})
    result = services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                                  workload={"ttft_slo_s": 2.0, "tpot_slo_s": 0.1}, workload_source="telemetry")
    # weights 1 and 3: output (16 + 60) / 4 = 19, cached (500 + 2100) / 4 - (150 + 570) / 4 = 650 - 180 = 470;
    # both windows have one shape, so their mixture has its quantiles
    assert {k: result.workload[k] for k in ("rate_per_s", "prompt_median", "prompt_p90", "prompt_cap",
                                            "output_median", "cached_prefix_mean")} == {
        "rate_per_s": 2.0, "prompt_median": 100, "prompt_p90": 300, "prompt_cap": 700, "output_median": 19,
        "cached_prefix_mean": 470.0}


def test_telemetry_workload_takes_quantiles_of_the_traffic_not_means_of_window_quantiles(two_dcs, profiles,
                                                                                          default_history):
    """Regression: nine windows of 10-token prompts and one holding a 4000-token prompt read as a median of 409 (the
    mean of the windows' medians); the traffic's median is 10, and the cap keeps the long prompt."""
    from apps.telemetry.selectors import history_scope

    now = time.time()
    for i, length in enumerate([10.0] * 9 + [4000.0]):
        default_history.append(history_scope(two_dcs["decode"].pk), now - 20 + i, {
            "at": now - 20 + i, "signals": _length_record(1.0, length, length, length, length, length, 16.0)})
    workload = selectors.telemetry_workload(pool=two_dcs["decode"], prefill_pool=two_dcs["prefill"])
    assert (workload["prompt_median"], workload["prompt_p90"], workload["prompt_cap"]) == (10, None, 4000)


def test_telemetry_workload_with_only_profiling_traffic_is_refused(two_dcs, profiles, default_history):
    """Regression: a profiling sweep alone (its requests counted, the length histograms empty) became a plan of the
    sweep's rate and lengths through the token counters."""
    from apps.telemetry.selectors import history_scope

    now = time.time()
    default_history.append(history_scope(two_dcs["decode"].pk), now - 5, {"at": now - 5, "signals": {
        "request_rate_per_s": 0.42, "request_sequences_per_s": 0.0, "prompt_tokens_per_s": 80.0,
        "generation_tokens_per_s": 2.0, "request_computed_prompt_tokens_p50": None,
        "request_prompt_tokens_mean": None}})
    with pytest.raises(ValidationError, match=r"no request traffic for pool dc-d/decode in its window \(profiling "):
        selectors.telemetry_workload(pool=two_dcs["decode"], prefill_pool=two_dcs["prefill"])


def test_telemetry_workload_without_traffic_is_refused(two_dcs, profiles, default_history):
    with pytest.raises(ValidationError) as refused:
        services.plan_create(prefill_pool=two_dcs["prefill"], decode_pool=two_dcs["decode"], link=two_dcs["link"],
                             workload={"ttft_slo_s": 2.0, "tpot_slo_s": 0.1}, workload_source="telemetry")
    assert "telemetry has no request traffic for pool dc-d/decode" in refused.value.message_dict["workload_source"][0]


def test_profiling_a_pool_without_a_ready_replica_fails_retryable_with_the_reason(two_dcs):
    action, created = services.profile_measure(pool=two_dcs["decode"], hardware_label="cpu")
    assert created and action.kind == "pool.profile" and action.params == {
        "hardware_label": "cpu", "lengths": [32, 128, 256, 512], "batch_sizes": [1, 2, 4], "max_new_tokens": 12}
    assert action_execute(action_id=action.pk) == "failed"
    action.refresh_from_db()
    assert (action.status, action.retryable, action.error) == (
        "failed", True, "pool dc-d/decode has no ready replica to profile; scale it up or wait for one")


def test_profiling_an_unreachable_worker_fails_retryable_naming_the_transport_error(two_dcs):
    from django.utils import timezone

    from apps.fleet.models import Replica

    Replica.objects.create(pool=two_dcs["decode"], track="stable", name="decode-0", endpoint="http://127.0.0.1:9",
                           ready=True, alive=True, last_seen=timezone.now())
    action, _ = services.profile_measure(pool=two_dcs["decode"], hardware_label="cpu")
    assert action_execute(action_id=action.pk) == "failed"
    action.refresh_from_db()
    assert action.retryable is True
    assert action.error.startswith("replica decode-0: ConnectError talking to http://127.0.0.1:9:")
    assert not Profile.objects.exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lengths": [32, 64]}, "lengths: give 3 to 8 distinct positive prompt lengths"),
    ({"batch_sizes": [1] * 3}, "batch_sizes: give 2 to 6 distinct positive batch sizes"),
    ({"max_new_tokens": 100}, "max_new_tokens must be in 4..64"),
    ({"hardware_label": "  "}, "name the hardware"),
])
def test_an_unbounded_sweep_is_refused(two_dcs, kwargs, message):
    with pytest.raises(ValidationError) as refused:
        services.profile_measure(pool=two_dcs["decode"], **{"hardware_label": "cpu", **kwargs})
    assert message in " ".join(refused.value.messages)
    assert not Action.objects.exists()


def test_ferry_profile_imports_a_file_and_names_what_is_wrong_with_a_malformed_one(two_dcs, tmp_path):
    out = io.StringIO()
    call_command("ferry_profile", "dc-p/prefill", "--import", str(FIXTURES / "prefill_profile.json"), stdout=out)
    profile = Profile.objects.get()
    assert out.getvalue() == f"imported profile #{profile.pk}: {profile}\n"
    bad = tmp_path / "bad.json"
    bad.write_text('{"hardware_label": "x", "prefill_points": "many"}')
    with pytest.raises(CommandError, match=r"bad.json: prefill_points: \['give a list of 1 to 64"):
        call_command("ferry_profile", "prefill", "--import", str(bad))
    with pytest.raises(CommandError, match="pool 'nope': no such pool"):
        call_command("ferry_profile", "nope", "--import", str(bad))


def test_ferry_profile_records_the_failed_sweep_on_its_action(two_dcs):
    with pytest.raises(CommandError, match=r"failed: pool dc-d/decode has no ready replica to profile.*\(retryable\)"):
        call_command("ferry_profile", str(two_dcs["decode"].pk), "--hardware-label", "cpu", stdout=io.StringIO())
    action = Action.objects.get(kind="pool.profile")
    assert (action.status, action.retryable, action.pool_id) == ("failed", True, two_dcs["decode"].pk)
