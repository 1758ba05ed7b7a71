"""The rollout controller: one tick advances one rollout (canary in :mod:`canary`, blue-green in :mod:`bluegreen`).

:func:`rollout_tick` locks the plan row, runs the strategy's tick (or its cleanup after an abort or failure),
saves the plan and commits; every pool-track change of the tick is a ``pool.*`` Action
(:mod:`apps.operations.tracks`) whose backend call runs after that commit, when no row lock is held. Abort and
failure (:func:`revert`) put traffic back on stable at once when stable has a ready replica, and keep
converging (``progress.cleanup``) until the new tracks are gone; an aborted rollout never applies another step.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from apps.rollouts import bluegreen, transitions
from apps.rollouts.canary import canary_cleanup, canary_converge, canary_mode, canary_tick
from apps.rollouts.desired import pool_views, publish, record_action, run_switches, track_delete, track_write
from apps.rollouts.gateway import gateway_sync
from apps.rollouts.models import RolloutPlan
from apps.rollouts.steps import RolloutFailure, step_position
from apps.rollouts.traffic import publish_if_changed

Phase = RolloutPlan.Phase


def revert(plan: RolloutPlan, *, event: str, reason: str, kind: str, requested_by=None,  # noqa: ANN001
           now: datetime | None = None, record: bool = True) -> None:
    """Abort or fail ``plan`` (row locked by the caller): traffic back to stable now, cleanup after.

    A blue-green switch already requested is switched back: the caller runs :func:`run_switches` once its
    transaction committed.
    """
    now = now or timezone.now()
    plan.state = transitions.next_state(event, plan.state, name=plan.name)
    prog = plan.typed_progress
    started = prog.started
    prog.analysis = None
    lines = [reason]
    if started:
        prog.cleanup = True
        plan.phase = Phase.REVERTING
        views = pool_views(plan)
        if plan.strategy == RolloutPlan.Strategy.BLUE_GREEN:
            changes = bluegreen.converge(plan, views)
            bluegreen.revert_switch(plan, views)
        else:
            changes = canary_converge(plan, views)
        publish_if_changed(plan, changes)
        lines += changes
    else:
        plan.phase = Phase.NONE
    plan.message = reason
    plan.step_started_at = now
    plan.next_step_at = now if started else None
    if record:  # a forced abort records one Action for the revert and its cleanup together
        record_action(plan, kind, lines, requested_by=requested_by, succeeded=kind != "rollout.fail", error=reason)


def force_cleanup(plan: RolloutPlan, *, switch_back: bool) -> list[str]:
    """Remove the rollout's new-version tracks now, whatever their readiness (``plan`` row locked by the caller).

    The operator's way out when a cleanup cannot converge (e.g. the old track has no ready replica, so the
    ordinary revert keeps waiting): per pool the old track gets the pool's total replicas, all the traffic
    (weight 100) and the active flag; the new track (``canary``, or the blue-green preview) is deleted, one
    ``pool.track_set`` / ``pool.track_delete`` Action each, and a blue-green switch is switched back. Ends the
    cleanup (``progress.cleanup`` false, phase none). ``switch_back``: request the blue-green switch back here
    (False when :func:`revert` just did). Returns the lines for the Action that records it."""
    prog, lines = plan.typed_progress, []
    views = pool_views(plan)
    if switch_back and plan.strategy == RolloutPlan.Strategy.BLUE_GREEN:
        bluegreen.revert_switch(plan, views)
    for view in views:
        old = prog.stable_tracks.get(view.key)
        new = prog.new_tracks.get(view.key) if plan.strategy == RolloutPlan.Strategy.BLUE_GREEN else "canary"
        if old is None or old not in view.tracks:
            continue
        if track_write(plan, view.tracks[old], replicas=max(view.total, view.tracks[old].replicas), weight=100,
                       active=True):
            lines.append(f"{view.pool}: {old} takes all the traffic and {view.total} replica(s)")
        if new and new != old and track_delete(plan, view, new):
            ready = view.ready.get(new, 0)
            lines.append(f"{view.pool}: {new} track removed ({ready} ready replica(s))")
    version = publish()
    prog.cleanup, prog.applied_weight = False, 0
    plan.phase, plan.next_step_at = Phase.NONE, None
    lines.append(f"force cleanup done: routing table v{version}")
    return lines


def status_text(plan: RolloutPlan, now: datetime) -> str:
    """The operator message of a progressing rollout that waits for nothing (1-based ``step N of M``).

    "All M steps done" only once the last step is over: while a last ``pause`` runs (``next_step_at`` after
    ``now``) or a last ``analysis`` runs, the message names that step."""
    prog = plan.typed_progress
    if plan.strategy == RolloutPlan.Strategy.BLUE_GREEN:
        if plan.phase == Phase.SWITCHED:
            return "Switched active to the preview."
        return f"At {step_position(plan)}; the preview takes no traffic yet."
    weight, target = prog.applied_weight, prog.weight
    traffic = f"canary weight {weight}%" + (f" (target {target}%)" if weight != target else "")
    if canary_mode(plan) == "finalize":
        return f"Finalizing: the stable tracks take {plan.target_model_version}; {traffic}."
    last_step_running = prog.analysis is not None or (plan.next_step_at is not None and plan.next_step_at > now)
    if plan.steps and plan.current_step_index >= len(plan.steps) and not last_step_running:
        return f"All {len(plan.steps)} steps done: {traffic}."
    return f"At {step_position(plan)}: {traffic}."


def _advance(plan: RolloutPlan, now: datetime, *, cleanup: bool) -> str:
    """Run the strategy's tick or cleanup on the locked ``plan``; a RolloutFailure becomes abort/fail."""
    blue_green = plan.strategy == RolloutPlan.Strategy.BLUE_GREEN
    try:
        if cleanup:
            return (bluegreen.cleanup if blue_green else canary_cleanup)(plan, now)
        plan.message = ""  # each tick says what holds the rollout now; no stale "Waiting for ..."
        result = (bluegreen.tick if blue_green else canary_tick)(plan, now)
        if not plan.message:
            plan.message = status_text(plan, now)
        return result
    except RolloutFailure as exc:
        kind = "rollout.abort" if exc.event == "gate_abort" else "rollout.fail"
        revert(plan, event=exc.event, reason=exc.reason, kind=kind, now=now)
        return plan.state


def rollout_tick(*, rollout_id: int, step_index: int | None = None, now: datetime | None = None) -> str:
    """Advance rollout ``rollout_id`` once; with ``step_index`` only if it is still at that step.

    Returns what happened: ``skipped`` (not progressing there: a duplicate delivery, or aborted),
    ``not-due``, ``waiting``, a step kind, ``analysis``, ``promoted``, ``aborted``, ``failed``, ...
    After the commit (row lock released) the tick's ``pool.switch_active`` Actions run (:func:`run_switches`)
    and Gateway API routes take the canary weight (:func:`apps.rollouts.gateway.gateway_sync`).
    """
    now = now or timezone.now()
    with transaction.atomic():
        qs = RolloutPlan.objects.select_for_update().filter(pk=rollout_id)
        if step_index is not None:
            qs = qs.filter(current_step_index=step_index)
        plan = qs.first()
        if plan is None:
            return "skipped"
        cleanup = plan.state in (transitions.ABORTED, transitions.FAILED) and plan.typed_progress.cleanup
        if plan.state != transitions.PROGRESSING and not cleanup:
            return "skipped"
        if plan.next_step_at is not None and plan.next_step_at > now:
            return "not-due"
        result = _advance(plan, now, cleanup=cleanup)
        plan.save()
    run_switches(rollout_id)
    gateway_sync(rollout_id)  # Gateway API routes take the tick's canary weight (apps.rollouts.gateway)
    return result
