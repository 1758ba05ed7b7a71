"""Reads for planning: profiles, plans, a pool's recent traffic as a workload, and measured TTFT beside a plan."""

from __future__ import annotations

import math
import time

import numpy as np
from django.core.exceptions import ValidationError
from django.db.models import Case, IntegerField, QuerySet, Value, When

from apps.fleet.models import Pool
from apps.planning.models import PlanResult, Profile
from apps.telemetry.selectors import telemetry_histories
from inference_worker.engine_kinds import FERRY
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


def _traffic_rate(record: dict) -> float | None:
    """A record's traffic: sequences answered per second (profiling sweeps left out; each of a request's ``n``
    choices is a sequence), or, without request-length histograms (another engine), requests per second."""
    signals = record.get("signals", {})
    sequences = signals.get("request_sequences_per_s")
    return sequences if sequences is not None else signals.get("request_rate_per_s")


def _rate_weighted(records: list[dict], name: str) -> float | None:
    """The mean of signal ``name`` over ``records`` weighted by each record's traffic (:func:`_traffic_rate`: a
    window of more requests weighs more); None when no record with traffic has it."""
    pairs = [(w, r["signals"][name]) for r in records
             if (w := _traffic_rate(r) or 0.0) > 0 and r["signals"].get(name) is not None]
    weight = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / weight if weight > 0 else None


def _mixture_quantiles(records: list[dict], base: str, qs: tuple[float, ...]) -> tuple[list[float], float] | None:
    """Quantiles ``qs`` of the lengths over all of ``records``' windows, and the largest window p99, from each
    window's ``{base}_p50``, ``_p90`` and ``_p99``; None when no window with traffic has them.

    A window's distribution is taken as the CDF through ``(p50^2 / p90, 0.1)`` (the p10 of a log-normal with that
    median and p90), ``(p50, 0.5)``, ``(p90, 0.9)`` and ``(p99, 1)``, linear in log tokens, 0 below the first point
    (a window of one length is a step there); the windows' CDFs are averaged, weighted by their traffic
    (:func:`_traffic_rate`), and that mixture inverted. A mean of the windows' quantiles is not a quantile of the
    traffic: windows of 10-token prompts and a few holding one 4000-token prompt averaged to a "median" of 575
    tokens where 16 was sent.
    """
    windows = []
    for record in records:
        weight, signals = _traffic_rate(record) or 0.0, record.get("signals", {})
        points = [signals.get(f"{base}_{q}") for q in ("p50", "p90", "p99")]
        if weight > 0 and all(p is not None for p in points):
            p50, p90, p99 = (max(p, 1.0) for p in points)  # a quantile inside the first bucket (0, 1] reads below 1
            by_x: dict[float, float] = {}
            for x, f in zip((max(p50 * p50 / max(p90, p50), 1.0), p50, p90, p99), (0.1, 0.5, 0.9, 1.0), strict=True):
                by_x[x] = max(by_x.get(x, 0.0), f)
            xs = sorted(by_x)
            windows.append((weight, np.log(xs), np.maximum.accumulate([by_x[x] for x in xs])))
    if not windows:
        return None
    grid = np.unique(np.concatenate([lx for _, lx, _ in windows]))
    total = sum(w for w, _, _ in windows)
    cdf = sum(w * np.interp(grid, lx, f, left=0.0, right=1.0) for w, lx, f in windows) / total
    found = []
    for q in qs:
        k = min(int(np.searchsorted(cdf, q - 1e-12)), len(grid) - 1)  # the first grid point where it reaches q
        span = cdf[k] - cdf[k - 1] if k else 0.0
        t = 1.0 if span <= 0 else (q - cdf[k - 1]) / span
        log_x = grid[k] if t >= 1.0 else grid[k - 1] + t * (grid[k] - grid[k - 1])
        found.append(round(float(np.exp(log_x)), 6))  # exp(log(10)) is 10.000000000000002: no ceil to 11
    return found, round(float(np.exp(max(lx[-1] for _, lx, _ in windows))), 6)


def telemetry_workload(*, pool: Pool, prefill_pool: Pool | None = None, since_s: float | None = None) -> dict:
    """The workload of the requests ``pool`` (a decode or co-located pool) answered recently, over the telemetry
    history (its horizon is 15 minutes: "last hour's traffic" reads what telemetry keeps), from the best signals
    the pool's engine gives:

    1. Ferry's workers keep request-length histograms of every sequence they answer (a request's ``n`` choices are
       ``n`` sequences), prefilled there or remotely, profiling sweeps left out. The rate is the mean of
       ``request_sequences_per_s``; the computed prompt (tokens no prefix cache held) median and p90 are the
       quantiles of the traffic over the history (:func:`_mixture_quantiles`), the cap the largest window p99; the
       output is the mean output (the planner's outputs have one length: the mean keeps the decode work, where a
       quantile interpolated in a bucket would not for outputs of one length), and ``cached_prefix_mean`` = mean
       prompt - mean computed prompt, each weighted by its window's traffic. Buckets step by 1.5x and 2x
       (:data:`inference_worker.metrics.TOKEN_BUCKETS`): a quantile is interpolated within one. With the histograms
       and no observation in them (no traffic, or only profiling sweeps) the pool has no traffic; records without
       them (workers older than the histograms) fall to 3.
    2. Another engine with prompt and output length means (vLLM): constant lengths, the prompt split by the pool's
       ``prefix_cache_hit_rate``.
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
    no_traffic = ValidationError({"workload_source": [
        f"telemetry has no request traffic for pool {pool} in its window (profiling sweeps are not traffic); give "
        "the workload instead"]})
    # Histograms exist (a zero rate is no traffic, never a reason to read the counters, which count the sweeps).
    histograms = any(r.get("signals", {}).get("request_sequences_per_s") is not None for r in records)
    rate = _mean(records, "request_sequences_per_s" if histograms else "request_rate_per_s")
    if not rate:
        raise no_traffic
    found = _mixture_quantiles(records, "request_computed_prompt_tokens", (0.5, 0.9))
    prompt_mean = _rate_weighted(records, "request_prompt_tokens_mean")
    computed_mean = _rate_weighted(records, "request_computed_prompt_tokens_mean")
    output = _rate_weighted(records, "request_generation_tokens_mean")
    if histograms and pool.engine in ("", FERRY):
        if found is None or None in (prompt_mean, computed_mean, output):
            raise no_traffic
        (p50, p90), p99 = found
        median = max(1, round(p50))
        high = max(median, math.ceil(p90))
        return {"rate_per_s": rate, "prompt_median": median, "prompt_p90": high if high > median else None,
                "prompt_cap": max(high, math.ceil(p99)), "output_median": max(1, round(output)),
                "cached_prefix_mean": max(0.0, prompt_mean - computed_mean)}
    hit = _mean(records, "prefix_cache_hit_rate")
    if prompt_mean is not None and output is not None:
        total, output_median = prompt_mean, max(1, round(output))
    else:
        rate = _mean(records, "request_rate_per_s")
        prompt, generation = _mean(records, "prompt_tokens_per_s"), _mean(records, "generation_tokens_per_s")
        remote = histories[ids[1]] if len(ids) > 1 else []
        remote_prompt = _mean(remote, "prompt_tokens_per_s") or 0.0
        if not rate or not (prompt or remote_prompt) or not generation:
            raise no_traffic
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
    latencies weighted by each record's traffic (:func:`_traffic_rate`: sequences answered per second, profiling
    sweeps left out, which the workers keep out of the latency histograms too), ``request_rate_per_s`` that
    traffic's plain mean; ``since`` (epoch s) where that span starts, ``records`` how many records it holds, ``at`` the
    newest one's time. ``None`` where there is no data.
    """
    scenario = result.scenario
    ids = [scenario.prefill_pool_id, scenario.decode_pool_id]
    since = time.time() - MEASURED_WINDOW_S if result.applied_at is None else result.applied_at.timestamp()
    histories = telemetry_histories(pool_ids=ids, since_s=since)
    measured = {}
    for pool_id in ids:
        records = histories[pool_id]
        values = {s: _rate_weighted(records, s) for s in MEASURED_SIGNALS if s != "request_rate_per_s"}
        rates = [r for r in map(_traffic_rate, records) if r is not None]
        values["request_rate_per_s"] = sum(rates) / len(rates) if rates else None
        measured[str(pool_id)] = {"at": records[-1].get("at") if records else None,
                                  "since": records[0].get("at") if records else None, "records": len(records),
                                  **values}
    return {"predicted": {"ttft_p50_s": result.ttft_p50_s, "ttft_p90_s": result.ttft_p90_s, "tpot_s": result.tpot_s},
            "measured": measured}
