"""Reads for planning: profiles, plans, a pool's recent traffic as a workload, and measured TTFT beside a plan."""

from __future__ import annotations

import math

from django.core.exceptions import ValidationError
from django.db.models import Case, IntegerField, QuerySet, Value, When

from apps.fleet.models import Pool
from apps.planning.models import PlanResult, Profile
from apps.telemetry.selectors import telemetry_histories, telemetry_snapshots
from inference_worker.planning.profiles import FittedProfile, colocated_overhead_s

MEASURED_SIGNALS = ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "request_rate_per_s")
"""Telemetry signals shown beside a plan's prediction (``None`` where telemetry has no data). Telemetry has no TTFT p90
signal (its quantiles are p50, p95, p99): the page shows measured p95 beside predicted p90, labelled as such."""

PAGE_WORKLOAD = {"prompt_median": 128, "prompt_p90": 384, "prompt_cap": 512, "output_median": 16, "rate_per_s": 0.5,
                 "ttft_slo_s": 2.0, "tpot_slo_s": 0.2, "attainment": 0.9, "cached_prefix_mean": 0}
"""The planning page's starting workload (tokens, req/s, s): one the demo fleet can meet, so a first plan on
``make run``'s CPU workers is a recommendation, not a refusal. Their sweep measures prompts up to 512 tokens (a
512-token prefill takes about 1.4 s there, a decode step of 2 sequences about 0.13 s): a p90 of 1024 tokens and a
TPOT of 0.1 s could not be met by any number of those replicas."""


def profile_list() -> QuerySet[Profile]:
    """Profiles, newest first, with their model version."""
    return Profile.objects.select_related("model_version")


def plan_list() -> QuerySet[PlanResult]:
    """Plan results, newest first, with their scenario's pools and link."""
    return PlanResult.objects.select_related("scenario", "scenario__prefill_pool", "scenario__decode_pool",
                                             "scenario__link")


def profile_for_pool(*, pool: Pool) -> Profile | None:
    """The profile the planner uses for ``pool``: of its model version and role, the pool's own newest profile,
    else the newest of any pool (an imported one, or one measured on a sibling pool); None if there is none."""
    return (Profile.objects.filter(model_version_id=pool.model_version_id, pool_kind=pool.role)
            .annotate(own=Case(When(pool_id=pool.pk, then=Value(0)), default=Value(1), output_field=IntegerField()))
            .order_by("own", "-created_at", "-id").first())


def fitted(profile: Profile) -> FittedProfile:
    """The stored profile as the planner's :class:`FittedProfile` (no KV capacity stored: unlimited; the co-located
    overhead from its co-located points, None without them)."""
    a0, a1, a2 = profile.prefill_coefficients
    b0, b1 = profile.decode_coefficients
    capacity = math.inf if profile.kv_capacity_bytes is None else float(profile.kv_capacity_bytes)
    colocated = [tuple(p) for p in profile.colocated_prefill_points or []]
    return FittedProfile((a0, a1, a2), (b0, b1), capacity, 1.0, profile.hardware_label,
                         colocated_overhead_s((a0, a1, a2), colocated) if colocated else None)


def _mean(records: list[dict], name: str) -> float | None:
    values = [r["signals"].get(name) for r in records if r.get("signals", {}).get(name) is not None]
    return sum(values) / len(values) if values else None


def telemetry_workload(*, pool: Pool) -> dict:
    """The workload of ``pool``'s recent traffic: the mean request rate over the telemetry history (its horizon is
    15 minutes: "last hour's traffic" reads what telemetry keeps) and constant prompt and output lengths from the
    means ``prompt_tokens_per_s / request_rate_per_s`` and ``generation_tokens_per_s / request_rate_per_s``.

    A prompt's tokens split by the pool's mean ``prefix_cache_hit_rate`` (tokens found in the prefix cache / tokens
    looked up): the found share is ``cached_prefix_mean``, the rest the computed prompt length (the planner's
    prompt lengths are computed tokens). Without that signal nothing is cached.

    Raises:
        ValidationError: no request traffic in the window.
    """
    records = telemetry_histories(pool_ids=[pool.pk])[pool.pk]
    rate = _mean(records, "request_rate_per_s")
    prompt, generation = _mean(records, "prompt_tokens_per_s"), _mean(records, "generation_tokens_per_s")
    if not rate or not prompt or not generation:
        raise ValidationError({"workload_source": [
            f"telemetry has no request traffic for pool {pool} in its window; give the workload instead"]})
    hit = min(max(_mean(records, "prefix_cache_hit_rate") or 0.0, 0.0), 1.0)
    total = prompt / rate
    computed = max(1, round(total * (1 - hit)))
    return {"rate_per_s": rate, "prompt_median": computed, "prompt_p90": None, "prompt_cap": computed,
            "output_median": max(1, round(generation / rate)), "cached_prefix_mean": total - computed if hit else 0.0}


def plan_measured(*, result: PlanResult) -> dict:
    """Predicted vs measured for a plan's two pools: ``{"predicted": {...}, "measured": {pool id: {signal: value}}}``
    (the newest telemetry record of each pool; ``None`` where there is no data)."""
    scenario = result.scenario
    ids = [scenario.prefill_pool_id, scenario.decode_pool_id]
    snapshots = telemetry_snapshots(pool_ids=ids)
    measured = {}
    for pool_id in ids:
        record = snapshots.get(pool_id)
        signals = (record or {}).get("signals", {})
        measured[str(pool_id)] = {"at": (record or {}).get("at"), **{s: signals.get(s) for s in MEASURED_SIGNALS}}
    return {"predicted": {"ttft_p50_s": result.ttft_p50_s, "ttft_p90_s": result.ttft_p90_s, "tpot_s": result.tpot_s},
            "measured": measured}
