"""Writes for rollout plans: create, update and delete (pending plans only for changes), and the verbs
start, pause, resume, promote, abort and rollback (transitions from :mod:`apps.rollouts.transitions`;
each writes one ``rollout.<verb>`` Action in the same transaction as the state change)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from celery import current_app
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from apps.catalog.models import ModelVersion
from apps.core.errors import ConflictError
from apps.fleet.models import Pool, Router
from apps.fleet.worker_args import InvalidWorkerArgs, parse_worker_args
from apps.rollouts import bluegreen, transitions
from apps.rollouts.canary import NEW_TRACK, canary_converge
from apps.rollouts.controller import force_cleanup, revert
from apps.rollouts.desired import active_track_name, pool_views, record_action, run_switches, track_ensure
from apps.rollouts.gateway import gateway_sync
from apps.rollouts.models import RolloutPlan
from apps.rollouts.progress import RolloutProgress
from apps.rollouts.replica_math import ReplicaMathError, canary_split
from apps.rollouts.selectors import rollout_active_for_pool
from apps.rollouts.steps import RolloutFailure, step_position
from apps.rollouts.traffic import publish_if_changed

logger = logging.getLogger(__name__)

ADVANCE_TASK = "rollouts.advance"
"""Name of the Celery task that advances one rollout (:func:`apps.rollouts.tasks.rollout_advance`)."""


def canary_track(view) -> bool:  # noqa: ANN001 - a PoolView
    return NEW_TRACK in view.tracks


def rollout_plan_validate_pools(*, pools: list[Pool], target: ModelVersion, plan_id: int | None) -> None:
    """Check a plan's pools against its target (read-only; the admin form calls it too).

    Raises:
        ValidationError: no pools, pools on different stable versions, target already running,
            or prefill pools without decode pools (or the reverse).
        ConflictError: a pool is in another active rollout.
    """
    if not pools:
        raise ValidationError({"pools": ["A rollout needs at least one pool."]})
    versions = {p.model_version_id for p in pools}
    if len(versions) != 1:
        raise ValidationError({"pools": ["All pools must currently run the same stable model version."]})
    if target.pk in versions:
        raise ValidationError({"target_model_version": ["The pools already run this version."]})
    roles = {p.role for p in pools}
    if (Pool.Role.PREFILL in roles) != (Pool.Role.DECODE in roles):
        raise ValidationError({"pools": [
            "Prefill and decode pools roll out together (KV is only valid between identical weights): "
            "include both the prefill and the decode pool."
        ]})
    for pool in pools:
        other = rollout_active_for_pool(pool=pool, exclude_id=plan_id)
        if other is not None:
            raise ConflictError(f"Pool {pool} is already in rollout {other.name!r} ({other.state}).")


def _validate_worker_args(worker_args: str, pools: list[Pool]) -> None:
    """Fault-injection worker options only when every pool's cluster is marked non-production."""
    production = sorted({pool.cluster.name for pool in pools if pool.cluster.production})
    if not worker_args or not production:
        return
    try:
        parse_worker_args(worker_args, faults_allowed=False)
    except InvalidWorkerArgs as exc:
        raise ValidationError({"worker_args": [f"{exc} (production clusters: {', '.join(production)})"]}) from exc


def _validate_router(router: Router | None, pools: list[Pool]) -> None:
    """A plan's router is a registered one in the cluster of one of its pools (or none)."""
    clusters = {pool.cluster_id for pool in pools}
    if router is not None and router.cluster_id not in clusters:
        raise ValidationError({"router": [f"Router {router.name!r} runs in cluster {router.cluster.name!r}, which "
                                          "holds none of these pools; pick a router of their clusters."]})


def _checked_plan(*, pools: list[Pool], target_model_version: ModelVersion,
                  created_by: AbstractBaseUser | None = None, **fields: Any) -> RolloutPlan:
    plan = RolloutPlan(target_model_version=target_model_version, created_by=created_by, **fields)
    plan.full_clean()
    _validate_router(plan.router, pools)
    _validate_worker_args(plan.worker_args, pools)
    return plan


def rollout_plan_check(*, pools: Iterable[Pool], target_model_version: ModelVersion, **fields: Any) -> None:
    """Dry run of :func:`rollout_plan_create`: every check it makes (fields, steps, gates, router, worker
    options, pools against the target and other active rollouts), nothing saved. The create form's inline
    validation (``POST /api/v1/rollouts/validate/``).

    Raises:
        ValidationError, ConflictError: as :func:`rollout_plan_create` would.
    """
    pools = list(pools)
    _checked_plan(pools=pools, target_model_version=target_model_version, **fields)
    rollout_plan_validate_pools(pools=pools, target=target_model_version, plan_id=None)


def rollout_plan_create(
    *, pools: Iterable[Pool], target_model_version: ModelVersion, created_by: AbstractBaseUser | None = None,
    **fields: Any,
) -> RolloutPlan:
    """Create a pending plan.

    Raises:
        ValidationError: invalid steps/gates/fields, pools on different versions, target already
            running, or a prefill pool without a decode pool (and vice versa).
        ConflictError: a pool is already in an active rollout.
    """
    pools = list(pools)
    plan = _checked_plan(pools=pools, target_model_version=target_model_version, created_by=created_by, **fields)
    with transaction.atomic():
        rollout_plan_validate_pools(pools=pools, target=target_model_version, plan_id=None)
        plan.save()
        plan.pools.set(pools)
    return plan


def rollout_plan_update(*, plan: RolloutPlan, pools: Iterable[Pool] | None = None, **changes: Any) -> RolloutPlan:
    """Change a pending plan. Raises ConflictError once it has started; ValidationError as for create."""
    if plan.state != RolloutPlan.State.PENDING:
        raise ConflictError(f"Rollout {plan.name!r} is {plan.state}; only pending plans can be changed.")
    for field, value in changes.items():
        setattr(plan, field, value)
    plan.full_clean()
    new_pools = list(pools) if pools is not None else list(plan.pools.all())
    _validate_router(plan.router, new_pools)
    _validate_worker_args(plan.worker_args, new_pools)
    with transaction.atomic():
        rollout_plan_validate_pools(pools=new_pools, target=plan.target_model_version, plan_id=plan.pk)
        plan.save()
        if pools is not None:
            plan.pools.set(new_pools)
    return plan


def rollout_plan_delete(*, plan: RolloutPlan) -> None:
    """Delete a plan that is pending or finished. Raises ConflictError while it is progressing or paused."""
    if plan.state in (RolloutPlan.State.PROGRESSING, RolloutPlan.State.PAUSED):
        raise ConflictError(f"Rollout {plan.name!r} is {plan.state}; abort it before deleting.")
    if plan.typed_progress.cleanup:
        raise ConflictError(f"Rollout {plan.name!r} is still returning traffic to stable; delete it once that "
                            "finished (progress.cleanup is false).")
    with transaction.atomic():
        plan.delete()


# --------------------------------------------------------------------------- verbs (state machine)


def _locked(plan: RolloutPlan) -> RolloutPlan:
    return RolloutPlan.objects.select_for_update().get(pk=plan.pk)


def rollout_advance_enqueue(*, rollout_id: int, step_index: int | None) -> None:
    """Send ``rollouts.advance`` by its name (:data:`ADVANCE_TASK`, as ``operations.services.action_enqueue``
    sends its task: ``tasks.py`` is the top of this app and imports the controller, so no module imports it).
    If the broker is down the next beat tick advances the rollout instead."""
    try:
        current_app.signature(ADVANCE_TASK).apply_async(args=[rollout_id, step_index], retry=True,
                                                        retry_policy={"max_retries": 1, "interval_start": 0})
    except OperationalError:
        logger.warning("broker unreachable: rollout %s advances on the next beat tick", rollout_id)


def _enqueue_after_commit(plan: RolloutPlan) -> None:
    transaction.on_commit(lambda: rollout_advance_enqueue(rollout_id=plan.pk, step_index=plan.current_step_index))


def _check_weights(plan: RolloutPlan, views: list) -> None:
    for index, step in enumerate(plan.steps):
        if "set_weight" not in step:
            continue
        for view in views:
            try:
                canary_split(view.total, step["set_weight"], max_surge=plan.max_surge)
            except ReplicaMathError as exc:
                raise ConflictError(f"Step {index + 1} of {len(plan.steps)} on pool {view.pool}: {exc}") from exc


def _record_stable(plan: RolloutPlan, views: list) -> None:
    """Pool totals, stable tracks and their worker options at start (raises ConflictError: no stable track)."""
    try:
        stable = {v.key: active_track_name(v) for v in views}
    except ValueError as exc:
        raise ConflictError(str(exc)) from exc
    plan.typed_progress = RolloutProgress(
        totals={v.key: v.total for v in views}, stable_tracks=stable,
        # the stable release's worker options, for a rollback after promotion
        stable_worker_args={v.key: v.tracks[stable[v.key]].extra_args for v in views},
    )


def _start_canary(plan: RolloutPlan, views: list) -> list[str]:
    _check_weights(plan, views)
    for view in views:
        if canary_track(view):
            raise ConflictError(f"Pool {view.pool} already has a canary track; remove it first.")
        track_ensure(plan, view, NEW_TRACK, plan.target_model_version, active=True, extra_args=plan.worker_args)
    plan.phase = RolloutPlan.Phase.STEPS
    return canary_converge(plan, views)


def rollout_start(*, plan: RolloutPlan, requested_by: AbstractBaseUser | None = None,
                  now: datetime | None = None) -> RolloutPlan:
    """Start a pending rollout: record totals and stable tracks, create the canary/preview tracks.

    Canary: a ``canary`` track at 0 replicas and weight 0 (the first step moves it). Blue-green: the
    preview track at the pool total, inactive. Each track change is a ``pool.track_set`` Action requested by
    ``rollout:<id>`` (its backend call runs after commit). Publishes the routing table; the beat tick continues.

    Raises:
        ConflictError: not pending (message names the state and allowed verbs), a pool is in another
            rollout, a canary/preview track already exists, or a step's weight cannot be served
            with ``max_surge`` (the R=1 rule, :mod:`apps.rollouts.replica_math`).
        ValidationError: the pools no longer run one stable version, or already run the target.
    """
    now = now or timezone.now()
    with transaction.atomic():
        plan = _locked(plan)
        new_state = transitions.next_state("start", plan.state, name=plan.name)
        pools = list(plan.pools.all())
        rollout_plan_validate_pools(pools=pools, target=plan.target_model_version, plan_id=plan.pk)
        plan.typed_progress = RolloutProgress()
        views = pool_views(plan)
        _record_stable(plan, views)
        plan.stable_model_version = pools[0].model_version
        if plan.strategy == RolloutPlan.Strategy.CANARY:
            lines = _start_canary(plan, views)
        else:
            try:
                lines = bluegreen.start(plan, views)
            except RolloutFailure as exc:
                raise ConflictError(exc.reason) from exc
        lines = [f"{v.pool}: {v.total} replicas, stable track {plan.typed_progress.stable_tracks[v.key]}"
                 for v in views] + lines
        publish_if_changed(plan, lines)
        plan.state, plan.step_started_at, plan.next_step_at = new_state, now, now
        plan.message = f"Started: {plan.stable_model_version} -> {plan.target_model_version}."
        plan.save()
        record_action(plan, "rollout.start", lines, requested_by=requested_by)
        _enqueue_after_commit(plan)
    return plan


def rollout_pause(*, plan: RolloutPlan, requested_by: AbstractBaseUser | None = None) -> RolloutPlan:
    """Pause a progressing rollout where it is (traffic stays). Raises ConflictError in other states."""
    with transaction.atomic():
        plan = _locked(plan)
        plan.state = transitions.next_state("pause", plan.state, name=plan.name)
        plan.next_step_at = None
        plan.message = f"Paused by {requested_by or 'system'} at {step_position(plan)}."
        plan.save()
        record_action(plan, "rollout.pause", [plan.message], requested_by=requested_by)
    return plan


def rollout_resume(*, plan: RolloutPlan, requested_by: AbstractBaseUser | None = None,
                   now: datetime | None = None) -> RolloutPlan:
    """Resume a paused rollout (the progress deadline restarts). Raises ConflictError unless paused."""
    now = now or timezone.now()
    with transaction.atomic():
        plan = _locked(plan)
        plan.state = transitions.next_state("resume", plan.state, name=plan.name)
        plan.next_step_at, plan.step_started_at = now, now
        plan.message = f"Resumed by {requested_by or 'system'} at {step_position(plan)}."
        plan.save()
        record_action(plan, "rollout.resume", [plan.message], requested_by=requested_by)
        _enqueue_after_commit(plan)
    return plan


def rollout_promote(*, plan: RolloutPlan, requested_by: AbstractBaseUser | None = None,
                    now: datetime | None = None) -> RolloutPlan:
    """Skip the remaining steps: canary goes to 100% then finalizes; blue-green switches after its
    readiness and smoke test. Raises ConflictError unless progressing/paused, or when already promoting.
    """
    now = now or timezone.now()
    with transaction.atomic():
        plan = _locked(plan)
        new_state = transitions.next_state("promote", plan.state, name=plan.name)
        if plan.phase in (RolloutPlan.Phase.FINALIZING, RolloutPlan.Phase.SWITCHED):
            raise ConflictError(f"Rollout {plan.name!r} is already being promoted ({plan.phase}).")
        skipped = len(plan.steps) - plan.current_step_index
        plan.current_step_index = len(plan.steps)
        plan.typed_progress.analysis = None
        plan.state, plan.next_step_at, plan.step_started_at = new_state, now, now
        plan.message = f"Promoted by {requested_by or 'system'}: {skipped} remaining step(s) skipped."
        plan.save()
        record_action(plan, "rollout.promote", [plan.message], requested_by=requested_by,
                      params={"skipped_steps": skipped})
        _enqueue_after_commit(plan)
    return plan


def rollout_abort(*, plan: RolloutPlan, requested_by: AbstractBaseUser | None = None,
                  reason: str = "", force: bool = False) -> RolloutPlan:
    """Abort: traffic back to stable at once (when stable has a ready replica), pending steps cancelled,
    the new tracks removed by the following ticks; a blue-green switch is switched back (its
    ``pool.switch_active`` Action runs after the commit).

    ``force``: a cleanup that always converges (:func:`apps.rollouts.controller.force_cleanup`): the new-version
    tracks are removed now whatever their readiness, recorded as one ``rollout.abort`` Action (``params.force``)
    and one ``pool.*`` Action per track change. Allowed while the rollout runs and also after an abort or a
    failure whose cleanup has not finished (the way out of a cleanup that waits for ever).

    Raises:
        ConflictError: finished (promoted, or aborted/failed with nothing left to clean up), or aborted/failed with
            its cleanup running and no ``force`` (the message says force is the way out).
    """
    with transaction.atomic():
        plan = _locked(plan)
        cleaning = plan.state in (RolloutPlan.State.ABORTED, RolloutPlan.State.FAILED) and plan.typed_progress.cleanup
        if cleaning and not force:  # the generic 409 would say no verb is allowed, yet the forced cleanup is
            raise ConflictError(f"Rollout {plan.name!r} is {plan.state} and its cleanup is still running; abort with "
                                '{"force": true} removes the new-version tracks now.')
        if force and cleaning:
            message = reason or f"Cleanup forced by {requested_by or 'system'} ({plan.state}: {plan.message})"
            lines = [message]
        else:
            if force and plan.state in (RolloutPlan.State.ABORTED, RolloutPlan.State.FAILED):
                raise ConflictError(f"Rollout {plan.name!r} is {plan.state} and its cleanup is done: nothing to "
                                    "force.")
            message = reason or f"Aborted by {requested_by or 'system'} at {step_position(plan)}."
            revert(plan, event="abort", reason=message, kind="rollout.abort", requested_by=requested_by,
                   record=not force)
            lines = [message]
        if force:
            lines += force_cleanup(plan, switch_back=cleaning) if plan.typed_progress.started else []
            plan.message = f"{message} Forced cleanup: new-version tracks removed."
            record_action(plan, "rollout.abort", lines, requested_by=requested_by, params={"force": True})
        plan.save()
        if plan.typed_progress.cleanup:
            _enqueue_after_commit(plan)
    run_switches(plan.pk)
    gateway_sync(plan.pk)  # traffic back to stable on the Gateway API routes too
    return plan


def _previous_worker_args(plan: RolloutPlan) -> str:
    previous = plan.typed_progress.stable_worker_args
    return next((previous[key] for key in sorted(previous, key=int)), "")


def rollout_rollback(*, plan: RolloutPlan, requested_by: AbstractBaseUser | None = None) -> RolloutPlan:
    """After promotion: create and start a new rollout of the same pools back to the previous version.

    Canary rollbacks use one ``set_weight: 100`` step and no gates; blue-green ones the usual flow. The
    rollback's ``worker_args`` are the ones the stable track ran before this rollout (those of the first
    pool when the pools differed).

    Raises:
        ConflictError: the rollout is not promoted, or a pool is in another rollout.
    """
    with transaction.atomic():
        plan = _locked(plan)
        transitions.next_state("rollback", plan.state, name=plan.name)
        if plan.stable_model_version is None:
            raise ConflictError(f"Rollout {plan.name!r} has no previous version to go back to.")
        back = rollout_plan_create(
            pools=plan.pools.all(), target_model_version=plan.stable_model_version, created_by=requested_by,
            name=f"rollback of {plan.name}"[:100], strategy=plan.strategy,
            steps=[{"set_weight": 100}] if plan.strategy == RolloutPlan.Strategy.CANARY else [],
            gates=[], max_surge=max(plan.max_surge, 1), progress_deadline_s=plan.progress_deadline_s,
            max_weight_skew=plan.max_weight_skew, scale_down_delay_s=plan.scale_down_delay_s,
            router=plan.router, worker_args=_previous_worker_args(plan),
        )
        RolloutPlan.objects.filter(pk=back.pk).update(rollback_of=plan)
        record_action(plan, "rollout.rollback", [f"rollout #{back.pk} goes back to {plan.stable_model_version}"],
                      requested_by=requested_by, params={"rollout_id": back.pk})
        back = rollout_start(plan=back, requested_by=requested_by)
    return back
