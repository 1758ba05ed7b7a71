"""Writes for planning: record and import profiles, request a profiling Action, compute a plan, apply it.

Applying a plan writes nothing itself: it requests one ``pool.scale`` Action per pool through
:func:`apps.operations.pools.pool_scale` (the path of ``POST /api/v1/pools/{id}/scale/``) and sets the decode
pool's remote-threshold bounds through :func:`apps.operations.pools.pool_update` (the path of
``PATCH /api/v1/pools/{id}/``), recorded as a succeeded ``pool.set_threshold_bounds`` Action.
"""

from __future__ import annotations

import json
import math
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from apps.catalog.models import ModelVersion
from apps.fleet.models import ClusterLink, Pool
from apps.operations import pools
from apps.operations.models import Action
from apps.operations.services import action_create, action_record_done
from apps.planning import profiling, selectors
from apps.planning.models import PlanResult, PlanScenario, Profile
from apps.planning.recommend import FittedReplicaProfile, Workload, plan
from inference_worker.planning.profiles import FittedProfile, lowest_prefill_time_s
from inference_worker.planning.workload import LengthDistribution
from inference_worker.router.table import BOUND_FIELDS

POOL_PROFILE = "pool.profile"
"""Action kind of a profiling sweep (:mod:`apps.planning.handlers`)."""
POOL_SET_THRESHOLD_BOUNDS = "pool.set_threshold_bounds"
"""Action kind recording the bounds a plan set on a pool."""
THRESHOLD_BOUND_FACTORS = (0.5, 2.0)
"""The bounds a plan sets around its threshold ``T``: ``[0.5 T, 2 T]`` (scenario ``prfaas``'s ``bandwidth_aware``
``low``/``high``: the router's threshold may follow the link's load within them)."""
MAX_POINTS = 64
MAX_POINT_X = 1_000_000
"""The largest prompt length or batch size a profile point may have (the plans API's largest prompt)."""
MAX_POINT_SECONDS = 3600.0
"""The longest time a profile point may have: a prefill or a decode step of an hour is not a measurement."""
GROWTH_RTOL = 1e-9
"""A fitted prefill must grow by more than this share of its time across the measured lengths (above float noise)."""


def _points(value: Any, name: str, *, integer_x: bool = True) -> list[tuple[int, float]]:
    if not isinstance(value, list) or not value or len(value) > MAX_POINTS:
        raise ValidationError({name: [f"give a list of 1 to {MAX_POINTS} [x, seconds] pairs"]})
    points = []
    for i, item in enumerate(value):
        if (not isinstance(item, list | tuple) or len(item) != 2
                or any(isinstance(v, bool) or not isinstance(v, int | float) for v in item)):
            raise ValidationError({name: [f"item {i}: expected [x, seconds] (two numbers), got {item!r}"]})
        x, seconds = item
        # Range first: int() of NaN, an infinity or a float beyond MAX_POINT_X would raise or overflow the fit.
        if integer_x and not (1 <= x <= MAX_POINT_X and x == int(x)):
            raise ValidationError({name: [f"item {i}: x must be a positive whole number at most {MAX_POINT_X}, "
                                          f"got {x!r:.40}"]})
        if not (0 < seconds <= MAX_POINT_SECONDS):
            raise ValidationError({name: [f"item {i}: seconds must be a positive finite number at most "
                                          f"{MAX_POINT_SECONDS:g}, got {seconds!r}"]})
        points.append((int(x), float(seconds)))
    return points


def _check_prefill_grows(fitted: FittedProfile, lengths: set[int]) -> None:
    """Refuse a fitted prefill time that does not grow from the shortest to the longest measured prompt or is not
    positive from 1 token to the longest (a prompt shorter than those measured still takes time)."""
    a0, a1, a2 = fitted.prefill_coefficients
    low, high = min(lengths), max(lengths)
    ends = [float(fitted.prefill_time_s(low)), float(fitted.prefill_time_s(high))]
    if not (lowest_prefill_time_s(fitted.prefill_coefficients, 1, high) > 0
            and ends[1] - ends[0] > GROWTH_RTOL * ends[1]):
        raise ValidationError({"prefill_points": [
            f"the fitted prefill time {a0:.4g} + {a1:.4g} * N + {a2:.4g} * N^2 s must grow with the prompt length "
            f"over the measured lengths {low}..{high} and stay positive from 1 token to {high}; measure the prefill "
            "again (the time must grow with the prompt)"]})


def _colocated_points(value: Any) -> list[tuple[int, float]]:
    """Co-located prefill points: None or ``[]`` (not measured), else validated like the prefill points."""
    if value is None or (isinstance(value, list) and not value):
        return []
    return _points(value, "colocated_prefill_points")


def profile_fit(*, prefill_points: Any, decode_points: Any, kv_capacity_bytes: int | None = None,
                colocated_prefill_points: Any = None) -> FittedProfile:
    """Validate raw points and fit them (:meth:`FittedProfile.fit`: numpy least squares).

    Raises:
        ValidationError: malformed points (x outside ``1..MAX_POINT_X``, seconds outside ``(0, MAX_POINT_SECONDS]``),
            fewer than 3 prefill lengths or 2 batch sizes (distinct), a prefill fit that does not grow from the
            shortest to the longest measured prompt or is not positive from 1 token to the longest, or a decode step
            fit that does not grow with the batch (``b1 <= 0``: the planner's decode model needs it); co-located
            prefill points (optional: None or ``[]``) that are malformed.
    """
    prefill, decode = _points(prefill_points, "prefill_points"), _points(decode_points, "decode_points")
    colocated = _colocated_points(colocated_prefill_points)
    if len({n for n, _ in prefill}) < 3:
        raise ValidationError({"prefill_points": ["need at least 3 distinct prompt lengths"]})
    if len({b for b, _ in decode}) < 2:
        raise ValidationError({"decode_points": ["need at least 2 distinct batch sizes"]})
    if kv_capacity_bytes is not None and (isinstance(kv_capacity_bytes, bool) or not isinstance(kv_capacity_bytes, int)
                                          or kv_capacity_bytes <= 0):
        raise ValidationError({"kv_capacity_bytes": ["a positive whole number of bytes, or null"]})
    fitted = FittedProfile.fit(prefill_points=prefill, decode_points=decode,
                               kv_capacity_bytes=math.inf if kv_capacity_bytes is None else kv_capacity_bytes,
                               colocated_prefill_points=colocated)
    _check_prefill_grows(fitted, {n for n, _ in prefill})
    b0, b1 = fitted.decode_coefficients
    if not (b0 > 0 and b1 > 0):
        raise ValidationError({"decode_points": [
            f"the fitted decode step {b0:.4g} + {b1:.4g} * B s must have a positive intercept and slope; "
            "measure more batch sizes (the step time must grow with the batch)"]})
    return fitted


def profile_create(*, model_version: ModelVersion, pool_kind: str, hardware_label: str, source: str,
                   prefill_points: Any, decode_points: Any, kv_capacity_bytes: int | None = None,
                   pool: Pool | None = None, colocated_prefill_points: Any = None) -> Profile:
    """Store a profile: the raw points and their least-squares fit.

    Raises:
        ValidationError: see :func:`profile_fit`; an unknown ``pool_kind`` or ``source``; an empty label.
    """
    fitted = profile_fit(prefill_points=prefill_points, decode_points=decode_points,
                         kv_capacity_bytes=kv_capacity_bytes, colocated_prefill_points=colocated_prefill_points)
    profile = Profile(model_version=model_version, pool_kind=pool_kind, hardware_label=hardware_label, source=source,
                      pool=pool, prefill_points=[list(p) for p in _points(prefill_points, "prefill_points")],
                      decode_points=[list(p) for p in _points(decode_points, "decode_points")],
                      colocated_prefill_points=[list(p) for p in _colocated_points(colocated_prefill_points)],
                      prefill_coefficients=list(fitted.prefill_coefficients),
                      decode_coefficients=list(fitted.decode_coefficients), kv_capacity_bytes=kv_capacity_bytes)
    profile.full_clean()
    profile.save()
    return profile


IMPORT_KEYS = {"hardware_label", "source", "prefill_points", "decode_points", "colocated_prefill_points",
               "kv_capacity_bytes"}


def profile_import(*, pool: Pool, text: str) -> Profile:
    """Import a profile file (JSON text) for ``pool``: :func:`profile_import_data` of the parsed object.

    Raises:
        ValidationError: not JSON or nested too deeply, or see :func:`profile_import_data`.
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValidationError({"file": [f"not valid JSON: {exc}"]}) from exc
    except RecursionError as exc:
        raise ValidationError({"file": ["not a profile: the JSON nests too deeply (a profile nests 3 levels)"]}) from exc
    return profile_import_data(pool=pool, data=data)


def profile_import_data(*, pool: Pool, data: Any) -> Profile:
    """Store an imported profile for ``pool``'s model version and role.

    ``data``: ``{"hardware_label": str, "source": "imported" | "roofline" (default imported),
    "prefill_points": [[tokens, seconds], ...], "decode_points": [[batch, seconds], ...],
    "colocated_prefill_points": [[tokens, seconds], ...] (optional: prefills on a replica decoding one stream),
    "kv_capacity_bytes": int | null}``. Coefficients are always fitted here, never read from the file.

    Raises:
        ValidationError: not an object, an unknown key, a label over 100 characters, or invalid points (the
            message names the field).
    """
    if not isinstance(data, dict):
        raise ValidationError({"file": ["expected a JSON object with hardware_label, prefill_points, decode_points"]})
    unknown = sorted(set(data) - IMPORT_KEYS)
    if unknown:
        raise ValidationError({"file": [f"unknown keys {unknown}; allowed: {sorted(IMPORT_KEYS)}"]})
    source = data.get("source", Profile.Source.IMPORTED)
    if source not in (Profile.Source.IMPORTED, Profile.Source.ROOFLINE):
        raise ValidationError({"source": ["an imported profile's source is 'imported' or 'roofline'"]})
    label = data.get("hardware_label")
    if not isinstance(label, str) or not label.strip():
        raise ValidationError({"hardware_label": ["a non-empty string naming the hardware, e.g. 'h200x8'"]})
    return profile_create(model_version=pool.model_version, pool_kind=pool.role, hardware_label=label.strip(),
                          source=source, prefill_points=data.get("prefill_points"),
                          decode_points=data.get("decode_points"), kv_capacity_bytes=data.get("kv_capacity_bytes"),
                          pool=pool, colocated_prefill_points=data.get("colocated_prefill_points"))


def profile_measure(*, pool: Pool, hardware_label: str, lengths: list[int] | None = None,
                    batch_sizes: list[int] | None = None, max_new_tokens: int = profiling.DEFAULT_MAX_NEW_TOKENS,
                    requested_by: AbstractBaseUser | None = None, requester: str = "",
                    idempotency_key: str | None = None) -> tuple[Action, bool]:
    """Request a profiling sweep of ``pool`` (a pending ``pool.profile`` Action; it holds the pool's lock).

    Raises:
        ValidationError: an unbounded sweep (:func:`apps.planning.profiling.validate_sweep`) or an empty label.
        ConflictError: the pool has an active Action.
    """
    lengths = list(lengths or profiling.DEFAULT_LENGTHS)
    batch_sizes = list(batch_sizes or profiling.DEFAULT_BATCH_SIZES)
    try:
        profiling.validate_sweep(lengths, batch_sizes, max_new_tokens)
    except ValueError as exc:
        raise ValidationError({"sweep": [str(exc)]}) from exc
    if not hardware_label.strip():
        raise ValidationError({"hardware_label": ["name the hardware the pool runs on, e.g. 'cpu-2core'"]})
    return action_create(kind=POOL_PROFILE, target_type="pool", target_id=str(pool.pk), target_repr=str(pool),
                         pool=pool, requested_by=requested_by, requester=requester, idempotency_key=idempotency_key,
                         params={"hardware_label": hardware_label.strip(), "lengths": lengths,
                                 "batch_sizes": batch_sizes, "max_new_tokens": max_new_tokens})


def _workload(data: dict[str, Any]) -> Workload:
    try:
        return Workload(**data)
    except TypeError as exc:
        raise ValidationError({"workload": [str(exc)]}) from exc


def plan_create(*, prefill_pool: Pool, decode_pool: Pool, link: ClusterLink, workload: dict[str, Any],
                workload_source: str = PlanScenario.WorkloadSource.GIVEN, max_replicas: int = 16, name: str = "",
                requested_by: AbstractBaseUser | None = None) -> PlanResult:
    """Compute and store a plan for two pools: the scenario as asked and the planner's result.

    ``workload`` (units in the keys): ``prompt_median``, ``prompt_p90`` (or None), ``prompt_cap``,
    ``output_median`` tokens; ``rate_per_s``; ``ttft_slo_s``, ``tpot_slo_s``; ``attainment``, ``max_link_share``
    (0..1). With ``workload_source="telemetry"`` the lengths and rate come from the decode pool's telemetry (and
    the prefill pool's, for prompt tokens prefilled there: :func:`apps.planning.selectors.telemetry_workload`) and
    only the objectives from ``workload``.

    Raises:
        ValidationError: the pools do not run one model version, the link does not join their clusters, no
            profile exists for a pool, telemetry has no traffic, or no fleet of at most ``max_replicas`` replicas
            meets the objectives (the message says which).
    """
    if prefill_pool.role == Pool.Role.DECODE:
        raise ValidationError({"prefill_pool": [f"pool {prefill_pool} is a decode pool; choose a prefill (or "
                                                "colocated) pool"]})
    if decode_pool.role == Pool.Role.PREFILL:
        raise ValidationError({"decode_pool": [f"pool {decode_pool} is a prefill pool; choose a decode (or colocated) "
                                               "pool"]})
    if prefill_pool.model_version_id != decode_pool.model_version_id:
        raise ValidationError({"decode_pool": ["the prefill and decode pools must run the same model version"]})
    if (link.source_id, link.destination_id) != (prefill_pool.cluster_id, decode_pool.cluster_id):
        joins = {link.source_id, link.destination_id} == {prefill_pool.cluster_id, decode_pool.cluster_id}
        raise ValidationError({"link": [
            f"link {link} runs from the decode pool's cluster to the prefill pool's: the KV cache flows the other "
            f"way; choose the link {prefill_pool.cluster} -> {decode_pool.cluster}" if joins else
            f"link {link} does not join the pools' clusters ({prefill_pool.cluster} -> {decode_pool.cluster})"]})
    profiles = {}
    for field, pool in (("prefill_pool", prefill_pool), ("decode_pool", decode_pool)):
        profiles[field] = selectors.profile_for_pool(pool=pool)
        if profiles[field] is None:
            raise ValidationError({field: [f"no profile for pool {pool} ({pool.model_version}, {pool.role}): "
                                           "profile it (ferry_profile or the page) or import one"]})
    if workload_source == PlanScenario.WorkloadSource.TELEMETRY:
        used = {**workload, **selectors.telemetry_workload(pool=decode_pool, prefill_pool=prefill_pool)}
    else:
        used = dict(workload)
    _check_fits_context(decode_pool, used)
    fitted = {k: selectors.fitted(p) for k, p in profiles.items()}
    _check_positive_up_to(fitted, profiles, int(used.get("prompt_cap", 0) or 0))
    try:
        threshold, rec = plan(config=decode_pool.model_version.model_config(), prefill=fitted["prefill_pool"],
                              decode=fitted["decode_pool"], bandwidth_gbps=link.bandwidth_gbps,
                              rtt_s=link.rtt_ms / 1000, workload=_workload(used), max_replicas=max_replicas)
    except ValueError as exc:
        raise ValidationError({"workload": [str(exc)]}) from exc
    if rec is None:
        _check_one_prompt_fits(fitted, used)
        raise ValidationError({"workload": [
            f"no fleet of at most {max_replicas} replicas meets TTFT p{used.get('attainment', 0.9) * 100:.4g} "
            f"<= {used['ttft_slo_s']} s and TPOT <= {used['tpot_slo_s']} s at {used['rate_per_s']} req/s on these "
            "profiles; lower the rate, relax the objectives or allow more replicas"]})
    p = rec.prediction
    with transaction.atomic():
        scenario = PlanScenario.objects.create(name=name, prefill_pool=prefill_pool, decode_pool=decode_pool,
                                               link=link, workload_source=workload_source, workload=workload,
                                               created_by=requested_by)
        return PlanResult.objects.create(
            scenario=scenario, prefill_profile=profiles["prefill_pool"], decode_profile=profiles["decode_pool"],
            workload=used, prefill_replicas=rec.prefill_replicas, decode_replicas=rec.decode_replicas,
            fleet=rec.fleet.to_dict(), threshold_tokens=threshold, link_gbps=p.link_gbps, link_share=p.link_share,
            remote_share=p.remote_share, ttft_p50_s=p.ttft_p50_s, ttft_p90_s=p.ttft_p90_s, tpot_s=p.tpot_s,
            attainment=p.attainment, curve=rec.curve)


class PlanGone(Exception):
    """The plan was deleted (by a concurrent request) before the operation on it ran."""


def plan_delete(*, result: PlanResult) -> None:
    """Delete a plan: its result and the scenario it was computed for. The Actions an apply requested stay in the
    Action log; the profiles it used can be deleted once no other plan uses them."""
    with transaction.atomic():
        # The row lock orders a delete after an apply in flight (plan_apply holds it until its Actions commit).
        locked = PlanResult.objects.select_for_update().filter(pk=result.pk).select_related("scenario").first()
        if locked is not None:
            locked.scenario.delete()


def _after_cached(cached: float) -> str:
    return f" after {cached:.0f} cached" if cached else ""


def _check_fits_context(pool: Pool, used: dict[str, Any]) -> None:
    """Refuse prompts that, after the mean cached prefix, do not fit the model's context (its
    ``max_position_embeddings``): no worker would take them.

    Raises:
        ValidationError: on ``workload``, naming the lengths and the context.
    """
    context = pool.model_version.model_config().max_position_embeddings
    cap, cached = int(used.get("prompt_cap") or 0), float(used.get("cached_prefix_mean") or 0.0)
    if cap + cached > context:
        raise ValidationError({"workload": [
            f"prompts of up to {cap} tokens{_after_cached(cached)} ({cap + cached:.0f} in all) exceed the model's context of {context} "
            f"tokens ({pool.model_version}); lower prompt_cap or cached_prefix_mean"]})


def _check_one_prompt_fits(fitted: dict[str, FittedProfile], used: dict[str, Any]) -> None:
    """Refuse, saying so, a workload whose prompt at the attainment's percentile takes longer than the TTFT objective
    to prefill alone on the faster pool: no number of replicas shortens one prompt's prefill.

    Raises:
        ValidationError: on ``workload``, with the prompt, its prefill time and what to change.
    """
    workload = _workload(used)
    dist = LengthDistribution(workload.prompt_median, workload.prompt_p90, workload.prompt_cap)
    n = dist.quantile(workload.attainment)
    cached = workload.cached_prefix_mean
    fastest = min(float(FittedReplicaProfile(f, 1.0, cached).prefill_time_s(n)) for f in fitted.values())
    if fastest > workload.ttft_slo_s:
        raise ValidationError({"workload": [
            f"a prompt of {n} tokens{_after_cached(cached)} (the p{workload.attainment * 100:.4g} prompt) takes {fastest:.3g} s to "
            f"prefill on the faster pool's profile, alone: over the TTFT objective of {workload.ttft_slo_s} s at any "
            "number of replicas; relax the TTFT objective, shorten the prompts or profile faster hardware"]})


def _check_positive_up_to(fitted: dict[str, FittedProfile], profiles: dict[str, Profile], cap: int) -> None:
    """Refuse a plan whose prompts reach lengths where a profile's fitted prefill time is not positive: a quadratic
    fitted to short prompts may turn negative beyond them (the co-located time adds a non-negative constant).

    Raises:
        ValidationError: on the pool's field, naming the profile, the curve and the length.
    """
    if cap < 1:
        return
    for field, profile in fitted.items():
        if not lowest_prefill_time_s(profile.prefill_coefficients, 1, cap) > 0:
            raise ValidationError({field: [
                f"profile #{profiles[field].pk}: the fitted prefill time is not positive for some prompt of 1 to "
                f"{cap} tokens (the workload's cap); measure prompts up to that length or lower prompt_cap"]})


def threshold_bounds(threshold: int | None) -> tuple[int, int] | None:
    """``(floor(0.5 T), ceil(2 T))`` for a planned threshold ``T >= 1``; None for never (None) or always (<= 0)."""
    if threshold is None or threshold < 1:
        return None
    low, high = THRESHOLD_BOUND_FACTORS
    return math.floor(low * threshold), math.ceil(high * threshold)


def _set_bounds(pool: Pool, bounds: tuple[int | None, int | None], requested_by: AbstractBaseUser | None,
                message: str) -> Action:
    """Set (or, with ``None``, clear) the pool's remote-threshold bounds and record it as a succeeded Action."""
    values = dict(zip(BOUND_FIELDS, bounds, strict=True))
    pools.pool_update(pool=pool, requested_by=requested_by, **values)
    return action_record_done(kind=POOL_SET_THRESHOLD_BOUNDS, target_type="pool", target_id=str(pool.pk),
                              target_repr=str(pool), params=values, requested_by=requested_by, message=message)


def plan_apply(*, result: PlanResult, requested_by: AbstractBaseUser | None = None) -> list[dict]:
    """Apply a plan: scale each pool to its recommended replicas, then set the decode pool's threshold bounds
    (the router reads the bounds of the decode pool a request is planned for: :mod:`inference_worker.router.pipeline`).

    One transaction: both ``pool.scale`` Actions are created or neither (a busy pool refuses with 409). Each has
    the idempotency key ``plan-<id>:scale-<pool id>``; applying an applied plan again returns its first steps. The bounds step
    is skipped, with the reason recorded in the step, when the planned threshold is "never" or "always" remote. Returns the steps
    ``[{step, pool, status, action, reason}]`` (also stored on the result). Concurrent applies of one plan are
    ordered by a lock on its row: the later one returns the earlier one's steps.

    Raises:
        ConflictError: a pool has an active Action, or a key was reused.
        ValidationError: a replica count the pool refuses (e.g. outside its autoscaling min..max).
        PlanGone: the plan was deleted meanwhile (nothing is scaled).
    """
    steps: list[dict] = []
    with transaction.atomic():
        # The row lock orders concurrent applies of one plan: the second reads the first's steps and returns them.
        locked = PlanResult.objects.select_for_update().only("applied", "applied_at").filter(pk=result.pk).first()
        if locked is None:
            raise PlanGone(f"plan #{result.pk} was deleted before it could be applied; nothing was scaled")
        scenario = result.scenario  # exists while the row lock holds
        if locked.applied_at is not None:
            result.applied, result.applied_at = locked.applied, locked.applied_at
            return result.applied
        for pool, replicas in ((scenario.prefill_pool, result.prefill_replicas),
                               (scenario.decode_pool, result.decode_replicas)):
            action, _ = pools.pool_scale(pool=pool, replicas=replicas, requested_by=requested_by,
                                         idempotency_key=f"plan-{result.pk}:scale-{pool.pk}")
            steps.append({"step": "scale", "pool": pool.pk, "replicas": replicas, "status": "requested",
                          "action": action.pk, "reason": ""})
        bounds = threshold_bounds(result.threshold_tokens)
        pool = scenario.decode_pool
        step = {"step": "set_bounds", "pool": pool.pk, "status": "skipped", "action": None, "reason": ""}
        if bounds is None:
            step["reason"] = ("the plan never prefills remotely" if result.threshold_tokens is None
                              else "the plan prefills every prompt remotely")
            if any(getattr(pool, f) is not None for f in BOUND_FIELDS):
                # An earlier plan's bounds would keep steering the router against this plan: clear them.
                done = _set_bounds(pool, (None, None), requested_by,
                                   f"plan #{result.pk}: {step['reason']}; cleared the bounds an earlier setting left")
                step.update(status="done", action=done.pk, bounds=[None, None],
                            reason=step["reason"] + "; cleared the earlier bounds")
        else:
            done = _set_bounds(pool, bounds, requested_by, f"plan #{result.pk}: threshold {result.threshold_tokens} "
                                                           f"tokens, bounds {bounds[0]}..{bounds[1]}")
            step.update(status="done", action=done.pk, bounds=list(bounds))
        fixed = settings.FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS
        if fixed is not None:
            step["warning"] = (f"the routing table carries the fixed threshold FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS="
                               f"{fixed} (make run's demo sets it), which overrides the bounds: unset it for the "
                               "router to follow this plan's threshold")
            if result.prefill_replicas == 0:
                step["warning"] += (f"; meanwhile prompts over {fixed} tokens still go to the prefill pool, which "
                                    "this plan scales to 0: they are prefilled on the decode pool instead "
                                    "(router decision local_prefill_fallback)")
        steps.append(step)
        result.applied, result.applied_at = steps, timezone.now()
        result.save(update_fields=["applied", "applied_at"])
    return steps
