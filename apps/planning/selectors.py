"""Reads for planning: profiles, plans, a pool's recent traffic as a workload, and measured TTFT beside a plan."""

from __future__ import annotations

import math
import time

from django.core.exceptions import ValidationError
from django.db.models import Case, IntegerField, QuerySet, Value, When

from apps.fleet.models import Pool
from apps.planning.models import PlanResult, Profile
from apps.telemetry.selectors import telemetry_histories
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
    """Plan results, newest first, with their scenario's pools (and their clusters) and link."""
    return PlanResult.objects.select_related("scenario", "scenario__prefill_pool__cluster",
                                             "scenario__decode_pool__cluster", "scenario__link")


def plan_notes(*, result: PlanResult) -> list[str]:
    """What the planner's model leaves out for this plan's pools, in words: each pool of a local cluster the plan
    gives more than one replica. A local cluster is one machine (its agent starts the replicas as processes), so
    its replicas share that machine's cores or GPU, while the planner counts each at the profile's full speed
    (seen on ``make run``'s 2-core machine: a plan of 2 decode replicas predicted TTFT p50 0.34 s, 0.62 s was
    measured)."""
    notes = []
    for pool, replicas in ((result.scenario.prefill_pool, result.prefill_replicas),
                           (result.scenario.decode_pool, result.decode_replicas)):
        if replicas > 1 and pool.cluster.kind == pool.cluster.Kind.LOCAL:
            notes.append(f"{pool}: its {replicas} replicas would be processes on the one machine of the local "
                         f"cluster {pool.cluster.name}, sharing its cores; the planner counts each at the profile's "
                         "full speed, so there the prediction is optimistic")
    return notes


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


def _rate_weighted(records: list[dict], name: str) -> float | None:
    """The mean of signal ``name`` over ``records`` weighted by each record's ``request_rate_per_s`` (a window of
    more requests weighs more); None when no record with traffic has it."""
    pairs = [(r["signals"]["request_rate_per_s"], r["signals"][name]) for r in records
             if (r.get("signals", {}).get("request_rate_per_s") or 0) > 0 and r["signals"].get(name) is not None]
    weight = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / weight if weight > 0 else None


def telemetry_workload(*, pool: Pool, prefill_pool: Pool | None = None, since_s: float | None = None) -> dict:
    """The workload of the requests ``pool`` (a decode or co-located pool) answered recently, over the telemetry
    history (its horizon is 15 minutes: "last hour's traffic" reads what telemetry keeps): the mean request rate,
    and lengths from the best signals the pool's engine gives, in this order:

    1. Request-length histograms (Ferry workers observe every answered request, prefilled here or remotely):
       the computed prompt (tokens no prefix cache held) p50 and p90 as the log-normal's median and p90, its p99
       as the cap, the mean output as the output length (the planner's outputs have one length: the mean keeps the
       decode work, where a quantile interpolated in a bucket would not for outputs of one length), and
       ``cached_prefix_mean`` = mean prompt - mean computed prompt. Each is the request-rate-weighted mean of the records' windowed values (a window's quantile is
       Prometheus' ``histogram_quantile`` interpolation within a bucket; the buckets step by 1.5x and 2x,
       :data:`inference_worker.metrics.TOKEN_BUCKETS`).
    2. Prompt and output length means without computed tokens (vLLM): constant lengths, the prompt split
       by the pool's ``prefix_cache_hit_rate``.
    3. Token counters only: constant lengths from ``prompt_tokens_per_s / request_rate_per_s`` and
       ``generation_tokens_per_s / request_rate_per_s``. Prompt tokens count where they were prefilled, so the
       remote prefills of ``prefill_pool`` (when it is another pool) are added to ``pool``'s own, and the prefix
       cache hit rate is the two pools' rates weighted by their prompt tokens.

    In 2 and 3 a prompt's tokens split by the hit rate (tokens found in the prefix cache / tokens looked up): the
    found share is ``cached_prefix_mean``, the rest the computed prompt length (the planner's prompt lengths are
    computed tokens). Without that signal nothing is cached.

    ``since_s`` (epoch s): only records from then on (``bench/planner_check.py`` reads its load's span).

    Returns:
        The workload keys ``rate_per_s``, ``prompt_median``, ``prompt_p90`` (None: constant), ``prompt_cap``,
        ``output_median`` (tokens) and ``cached_prefix_mean`` (tokens).

    Raises:
        ValidationError: no request traffic in the window.
    """
    ids = [pool.pk] + ([prefill_pool.pk] if prefill_pool is not None and prefill_pool.pk != pool.pk else [])
    histories = telemetry_histories(pool_ids=ids, since_s=since_s)
    records = histories[pool.pk]
    rate = _mean(records, "request_rate_per_s")
    if not rate:
        raise ValidationError({"workload_source": [
            f"telemetry has no request traffic for pool {pool} in its window; give the workload instead"]})
    p50, p90, p99 = (_rate_weighted(records, f"request_computed_prompt_tokens_{q}") for q in ("p50", "p90", "p99"))
    prompt_mean = _rate_weighted(records, "request_prompt_tokens_mean")
    computed_mean = _rate_weighted(records, "request_computed_prompt_tokens_mean")
    output = _rate_weighted(records, "request_generation_tokens_mean")
    if p50 is not None and output is not None and prompt_mean is not None and computed_mean is not None:
        median = max(1, round(p50))
        high = max(median, math.ceil(p90 or median))
        return {"rate_per_s": rate, "prompt_median": median, "prompt_p90": high if high > median else None,
                "prompt_cap": max(high, math.ceil(p99 or high)), "output_median": max(1, round(output)),
                "cached_prefix_mean": max(0.0, prompt_mean - computed_mean)}
    hit = _mean(records, "prefix_cache_hit_rate")
    if prompt_mean is not None and output is not None:
        total, output_median = prompt_mean, max(1, round(output))
    else:
        prompt, generation = _mean(records, "prompt_tokens_per_s"), _mean(records, "generation_tokens_per_s")
        remote = histories[ids[1]] if len(ids) > 1 else []
        remote_prompt = _mean(remote, "prompt_tokens_per_s") or 0.0
        if not (prompt or remote_prompt) or not generation:
            raise ValidationError({"workload_source": [
                f"telemetry has no request traffic for pool {pool} in its window; give the workload instead"]})
        remote_hit = _mean(remote, "prefix_cache_hit_rate")
        if remote_prompt and remote_hit is not None:
            hit = ((hit or 0.0) * (prompt or 0.0) + remote_hit * remote_prompt) / ((prompt or 0.0) + remote_prompt)
        total, output_median = ((prompt or 0.0) + remote_prompt) / rate, max(1, round(generation / rate))
    hit = min(max(hit or 0.0, 0.0), 1.0)
    computed = max(1, round(total * (1 - hit)))
    return {"rate_per_s": rate, "prompt_median": computed, "prompt_p90": None, "prompt_cap": computed,
            "output_median": output_median, "cached_prefix_mean": max(0.0, total - computed) if hit else 0.0}


MEASURED_WINDOW_S = 300.0
"""Seconds of telemetry a plan that was never applied (or was applied longer ago than telemetry keeps) is measured
over."""


def plan_measured(*, result: PlanResult) -> dict:
    """Predicted vs measured for a plan's two pools: ``{"predicted": {...}, "measured": {pool id: {...}}}``.

    Measured, per pool: each of :data:`MEASURED_SIGNALS` over the telemetry records since the plan was applied (the
    last :data:`MEASURED_WINDOW_S` seconds if it was not, or telemetry no longer holds its apply time), the
    latencies weighted by each record's request rate (a window with more requests weighs more), the request rate
    their plain mean; ``since`` (epoch s) where that span starts, ``records`` how many records it holds, ``at`` the
    newest one's time. ``None`` where there is no data.
    """
    scenario = result.scenario
    ids = [scenario.prefill_pool_id, scenario.decode_pool_id]
    since = time.time() - MEASURED_WINDOW_S if result.applied_at is None else result.applied_at.timestamp()
    histories = telemetry_histories(pool_ids=ids, since_s=since)
    measured = {}
    for pool_id in ids:
        records = histories[pool_id]
        values = {s: (_mean if s == "request_rate_per_s" else _rate_weighted)(records, s) for s in MEASURED_SIGNALS}
        measured[str(pool_id)] = {"at": records[-1].get("at") if records else None,
                                  "since": records[0].get("at") if records else None, "records": len(records),
                                  **values}
    return {"predicted": {"ttft_p50_s": result.ttft_p50_s, "ttft_p90_s": result.ttft_p90_s, "tpot_s": result.tpot_s},
            "measured": measured}
