"""The rollout controller: one tick advances one rollout (canary here, blue-green in :mod:`bluegreen`).

Canary, per tick of a progressing plan (plan row locked, see :mod:`apps.rollouts.steps`):

1. **Converge** the current target (``progress.mode``/``weight``): per pool, the split of
   :func:`replica_math.canary_split` reached by surge-limited moves (:func:`replica_math.next_replicas`),
   and the canary weight that may be published now (:func:`replica_math.applied_weight`: no traffic
   to a track with zero ready replicas; prefill/decode kept within ``max_weight_skew``). A change
   publishes the routing table and the plan waits for the router to report that version. No pool's
   track loses its last replica while its model version still has weight (:func:`traffic_floor`),
   and a shrinking track keeps its replicas until the router applied the table (:func:`scale_down_hold`).
2. Not settled yet (replicas not ready, weight not reached, router behind) -> wait, unless the step is
   older than ``progress_deadline_s``: then the rollout fails and traffic returns to stable.
3. Settled: a running analysis is evaluated; else the next step is applied (claimed by index).
   After the last step the weight goes to 100 (a plan whose last weight is below 100 still ends
   at 100%), then **finalize**: the stable track takes the new version and the plan's
   ``worker_args`` (the new release's worker options) and the replicas move back from ``canary`` to
   it, the canary track is removed and the rollout is ``promoted``.

Abort and failure (**revert**) put traffic back on stable at once when stable has a ready replica,
and keep converging (``progress.cleanup``) until the canary track is gone; an aborted rollout never
applies another step.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from apps.rollouts import bluegreen, transitions
from apps.rollouts.desired import (
    PoolView,
    pool_views,
    publish,
    record_action,
    router_applied_version,
    step_action_log,
    track_delete,
    track_write,
)
from apps.rollouts.models import RolloutPlan
from apps.rollouts.replica_math import ReplicaMathError, applied_weight, canary_split, next_replicas
from apps.rollouts.steps import (
    RolloutFailure,
    analysis_tick,
    apply_pause_or_analysis,
    check_deadline,
    claim_step,
    schedule,
    step_label,
    step_position,
)

NEW_TRACK = "canary"


def canary_targets(plan: RolloutPlan, view: PoolView) -> dict[str, int]:
    """Desired replicas per track for the plan's current mode (raises ReplicaMathError)."""
    prog = plan.progress
    stable = prog["stable_tracks"][view.key]
    if prog["mode"] == "canary":
        canary, kept = canary_split(view.total, prog["weight"], max_surge=plan.max_surge)
        return {stable: kept, NEW_TRACK: canary}
    return {stable: view.total, NEW_TRACK: 0}


def replicas_text(count: int) -> str:
    """``1 replica``, ``2 replicas``."""
    return f"{count} replica" + ("" if count == 1 else "s")


def _ready(view: PoolView, name: str) -> int:
    track = view.tracks.get(name)
    return min(view.ready.get(name, 0), track.replicas) if track is not None else 0


def canary_converge(plan: RolloutPlan, views: list[PoolView]) -> list[str]:
    """Write the next desired replicas and weights of every pool; returns lines describing changes.

    Traffic leaves a track before its replicas do: the weights are computed from the replica counts after
    this move, then a shrinking track keeps the replicas its traffic still needs (:func:`traffic_floor`,
    for every pool: a prefill pool's track serves the decode traffic of its model version), and it keeps
    them all until the router reports the routing table that takes the traffic away
    (:func:`scale_down_hold`); growing tracks move at once.
    """
    prog, lines = plan.progress, []
    planned: dict[str, dict[str, int]] = {}
    shrinks: list[tuple[PoolView, str, int, int]] = []
    grew = False
    for view in views:
        if NEW_TRACK not in view.tracks:
            continue
        target = canary_targets(plan, view)
        desired = {name: view.tracks[name].replicas for name in target}
        ready = {name: _ready(view, name) for name in target}
        moved = next_replicas(desired=desired, ready=ready, target=target, total=view.total,
                              max_surge=plan.max_surge)
        planned[view.key] = moved
        for name, replicas in moved.items():
            if replicas < desired[name]:
                shrinks.append((view, name, desired[name], replicas))
            elif track_write(view.tracks[name], replicas=replicas):
                grew = True
                lines.append(f"{view.pool}: {name} replicas {desired[name]} -> {replicas}")

    def ready_after(view: PoolView, name: str) -> int:
        return min(view.ready.get(name, 0), planned[view.key].get(name, 0))

    serving = [v for v in views if v.serving and NEW_TRACK in v.tracks] or [v for v in views if NEW_TRACK in v.tracks]
    ready_new = sum(ready_after(v, NEW_TRACK) for v in serving)
    ready_stable = sum(ready_after(v, prog["stable_tracks"][v.key]) for v in serving)
    previous = prog.get("applied_weight", 0)
    if prog["mode"] == "canary":
        shares = {v.key: (ready_after(v, NEW_TRACK), canary_targets(plan, v)[NEW_TRACK]) for v in views
                  if NEW_TRACK in v.tracks}
        weight = applied_weight(weight=prog["weight"], previous=previous, shares=shares,
                                skew=plan.max_weight_skew, serving_ready=ready_new)
    elif prog["mode"] == "finalize":  # both tracks run the new version: split by ready replicas
        weight = previous if ready_new + ready_stable == 0 else round(100 * ready_new / (ready_new + ready_stable))
    else:  # revert: back to stable as soon as it can serve
        weight = 0 if ready_stable > 0 else previous
    kept = traffic_floor(plan, shrinks, weight)
    if plan.max_surge == 0 and not grew and kept and all(after == before for _, _, before, after in kept):
        # No surge room and the only move left removes the last replica of a track that still has traffic
        # (Kubernetes' maxUnavailable = 1): move the traffic first, then the replica goes.
        if prog["mode"] == "canary" and ready_new > 0 and weight < prog["weight"]:
            weight = prog["weight"]
            kept = traffic_floor(plan, shrinks, weight)
        if all(after == before for _, _, before, after in kept):
            kept = shrinks  # nothing else can move: a replica has to go while its traffic is still there
    prog["applied_weight"] = weight
    changed = False
    for view in views:
        if NEW_TRACK in view.tracks:
            changed |= track_write(view.tracks[NEW_TRACK], weight=weight)
            changed |= track_write(view.tracks[prog["stable_tracks"][view.key]], weight=100 - weight)
    if changed:
        lines.append(f"canary weight {previous}% -> {weight}%")
    held = scale_down_hold(plan, weights_changed=changed) if kept else None
    for view, name, before, after in kept:
        if held is None and track_write(view.tracks[name], replicas=after):
            lines.append(f"{view.pool}: {name} replicas {before} -> {after}")
    floored = [(view, name) for (view, name, _, wanted), (*_, after) in zip(shrinks, kept, strict=True)
               if after > wanted]
    if held is None and floored:
        view, name = floored[0]
        share = weight if name == NEW_TRACK else 100 - weight
        held = (f"{view.pool} {name} to lose its traffic before its last replica stops "
                f"({view.tracks[name].model_version} still gets {share}%)")
    if held is not None:
        prog["scale_down_held"] = held
    else:
        prog.pop("scale_down_held", None)
    return lines


def traffic_floor(plan: RolloutPlan, shrinks: list[tuple[PoolView, str, int, int]],
                  weight: int) -> list[tuple[PoolView, str, int, int]]:
    """``shrinks`` (``(view, track, before, after)``) with ``after`` raised to keep one replica of every
    track whose model version still gets traffic at canary ``weight`` (percent).

    The router sends a request to a track by weight and then to a prefill replica of *that model version*
    (``inference_worker.router.decisions``): a prefill pool whose stable track went to zero while the decode
    stable track still had weight made every long prompt of that track fall back to local prefill, and a
    decode pool's would leave the track with no replica at all. Tracks running the same version
    (``finalize``: both the new one) serve each other's traffic and need no floor.
    """
    out = []
    for view, name, before, after in shrinks:
        stable = plan.progress["stable_tracks"][view.key]
        other = stable if name == NEW_TRACK else NEW_TRACK
        share = weight if name == NEW_TRACK else 100 - weight
        same_version = view.tracks[other].model_version_id == view.tracks[name].model_version_id
        if share > 0 and after == 0 and not same_version:
            after = min(before, 1)
        out.append((view, name, before, after))
    return out


def scale_down_hold(plan: RolloutPlan, *, weights_changed: bool) -> str | None:
    """Why replicas whose traffic was just moved away must stay for now (None: they may go).

    With a router (``router_url``) a track's replicas are removed only once the router reports the
    routing table that no longer sends them traffic: not in the tick that changes the weights, nor while
    the router is behind. Otherwise a request routed by the old table reaches a draining replica, and a
    retry cannot help when no other replica serves that track's version. The hold ends after
    ``progress_deadline_s`` from the start of the step (a router that never answers does not keep the
    replicas forever). Without a router nothing is held.
    """
    if not plan.router_url:
        return None
    started = plan.step_started_at
    if started is not None and (timezone.now() - started).total_seconds() > plan.progress_deadline_s:
        return None
    if weights_changed:
        return "the router to apply the new weights before replicas are removed"
    return router_behind(plan)


def canary_settled(plan: RolloutPlan, views: list[PoolView]) -> str | None:
    """What the current target still waits for (None: replicas ready, weight reached, router caught up)."""
    prog = plan.progress
    for view in views:
        if NEW_TRACK not in view.tracks:
            continue
        for name, want in sorted(canary_targets(plan, view).items()):
            track = view.tracks[name]
            if track.replicas > want and prog.get("scale_down_held"):
                return prog["scale_down_held"]
            if track.replicas > want:
                return (f"{view.pool} {name}: {replicas_text(track.replicas)}, going to {want} once the "
                        "replacements are ready")
            if track.replicas < want or _ready(view, name) < want:
                started = "" if track.replicas == want else f", {track.replicas} started"
                return f"{view.pool} {name}: {_ready(view, name)} of {replicas_text(want)} ready{started}"
            if want == 0 and name != NEW_TRACK and view.alive.get(name, 0):  # stable empty before it changes version
                return f"{view.pool} {name}: {replicas_text(view.alive[name])} still running (desired 0)"
    wanted = prog["weight"] if prog["mode"] == "canary" else 0
    if prog.get("applied_weight", 0) != wanted:
        return f"canary weight {prog.get('applied_weight', 0)}% (target {wanted}%)"
    return router_behind(plan)


def router_behind(plan: RolloutPlan) -> str | None:
    """None once the router (if any) reports the awaited routing-table version, else what is awaited."""
    awaited = plan.progress.get("await_version")
    if not plan.router_url or awaited is None:
        return None
    seen = router_applied_version(plan.router_url)
    if seen is not None and seen >= awaited:
        return None
    return f"the router at {plan.router_url} to apply routing table v{awaited} (it reports {seen})"


def publish_if_changed(plan: RolloutPlan, lines: list[str]) -> None:
    """After desired-state changes: publish the routing table and wait for its version."""
    if lines:
        plan.progress["await_version"] = publish()
        lines.append(f"routing table v{plan.progress['await_version']}")


def _apply_canary_step(plan: RolloutPlan, views: list[PoolView], index: int, now: datetime) -> str:
    if not claim_step(plan, index):
        return "skipped"
    (kind, arg), = plan.steps[index].items()
    lines = [step_label(plan, index)]
    plan.step_started_at = now
    outcome = kind
    if kind == "set_weight":
        plan.progress["weight"] = arg
        changes = canary_converge(plan, views)
        publish_if_changed(plan, changes)
        lines += changes
        schedule(plan, now, 0)
    else:
        outcome = apply_pause_or_analysis(plan, index, kind, arg, now, lines)
    record_action(plan, "rollout.step", lines, params={"step_index": index, "step": plan.steps[index]},
                  idempotency_key=f"rollout-{plan.pk}-step-{index}")
    return outcome


def _finish(plan: RolloutPlan, views: list[PoolView], now: datetime) -> str:
    for view in views:
        track_delete(view, NEW_TRACK)
        type(view.pool).objects.filter(pk=view.pool.pk).update(model_version=plan.target_model_version)
    version = publish()
    plan.state = transitions.next_state("complete", plan.state, name=plan.name)
    plan.phase, plan.next_step_at = "", None
    plan.message = f"Promoted: every pool runs {plan.target_model_version}."
    record_action(plan, "rollout.complete", [plan.message, f"routing table v{version}"])
    return "promoted"


def canary_tick(plan: RolloutPlan, now: datetime) -> str:
    """One canary tick (module docstring). Raises RolloutFailure to abort or fail."""
    views = pool_views(plan)
    prog = plan.progress
    try:
        changes = canary_converge(plan, views)
    except ReplicaMathError as exc:
        raise RolloutFailure("fail", str(exc)) from exc
    publish_if_changed(plan, changes)
    if changes:
        step_action_log(plan, "; ".join(changes))
    waiting = canary_settled(plan, views)
    if waiting is not None:
        check_deadline(plan, now, waiting)
        plan.message = f"Waiting for {waiting}."
        schedule(plan, now)
        return "waiting"
    if prog["mode"] == "finalize":
        return _finish(plan, views, now)
    if prog.get("analysis"):
        stable_tracks = {v.pool.pk: prog["stable_tracks"][v.key] for v in views}
        if not analysis_tick(plan, views, now, new_track=NEW_TRACK, stable_tracks=stable_tracks):
            return "analysis"
    index = plan.current_step_index
    if index < len(plan.steps):
        return _apply_canary_step(plan, views, index, now)
    plan.step_started_at = now
    if prog["weight"] != 100:
        prog["weight"] = 100
        lines = ["all steps done: canary weight to 100%"]
    else:
        prog["mode"] = "finalize"
        plan.phase = "finalizing"
        for view in views:
            track_write(view.tracks[prog["stable_tracks"][view.key]], model_version=plan.target_model_version,
                        extra_args=plan.worker_args)
        lines = [f"finalize: stable tracks move to {plan.target_model_version}"
                 + (f" with worker options {plan.worker_args!r}" if plan.worker_args else "")]
    changes = canary_converge(plan, views)
    lines += changes
    publish_if_changed(plan, lines)
    record_action(plan, "rollout.step", lines, params={"phase": prog["mode"], "weight": prog["weight"]})
    schedule(plan, now, 0)
    return "finalizing" if prog["mode"] == "finalize" else "to-100"


def canary_cleanup(plan: RolloutPlan, now: datetime) -> str:
    """Converge an aborted/failed canary back to stable; remove the canary track once it is safe."""
    views = pool_views(plan)
    changes = canary_converge(plan, views)
    publish_if_changed(plan, changes)
    if canary_settled(plan, views) is not None:
        schedule(plan, now)
        return "reverting"
    for view in views:
        track_delete(view, NEW_TRACK)
    version = publish()
    plan.progress["cleanup"] = False
    plan.next_step_at = None
    step_action_log(plan, f"reverted: canary tracks removed (routing table v{version})")
    return "reverted"


def revert(plan: RolloutPlan, *, event: str, reason: str, kind: str, requested_by=None,  # noqa: ANN001
           now: datetime | None = None) -> None:
    """Abort or fail ``plan`` (row locked by the caller): traffic back to stable now, cleanup after."""
    now = now or timezone.now()
    plan.state = transitions.next_state(event, plan.state, name=plan.name)
    started = bool(plan.progress.get("stable_tracks"))
    plan.progress.pop("analysis", None)
    lines = [reason]
    if started:
        plan.progress["mode"], plan.progress["cleanup"] = "revert", True
        views = pool_views(plan)
        changes = (bluegreen.converge(plan, views) if plan.strategy == RolloutPlan.Strategy.BLUE_GREEN
                   else canary_converge(plan, views))
        publish_if_changed(plan, changes)
        lines += changes
    plan.phase = "reverting" if started else ""
    plan.message = reason
    plan.step_started_at = now
    plan.next_step_at = now if started else None
    record_action(plan, kind, lines, requested_by=requested_by, succeeded=kind != "rollout.fail", error=reason)


def status_text(plan: RolloutPlan) -> str:
    """The operator message of a progressing rollout that waits for nothing (1-based ``step N of M``)."""
    prog = plan.progress
    if plan.strategy == RolloutPlan.Strategy.BLUE_GREEN:
        if plan.phase == "switched":
            return "Switched active to the preview."
        return f"At {step_position(plan)}; the preview takes no traffic yet."
    weight, target = prog.get("applied_weight", 0), prog.get("weight", 0)
    traffic = f"canary weight {weight}%" + (f" (target {target}%)" if weight != target else "")
    if prog.get("mode") == "finalize":
        return f"Finalizing: the stable tracks take {plan.target_model_version}; {traffic}."
    if plan.steps and plan.current_step_index >= len(plan.steps):
        return f"All {len(plan.steps)} steps done: {traffic}."
    return f"At {step_position(plan)}: {traffic}."


def rollout_tick(*, rollout_id: int, step_index: int | None = None, now: datetime | None = None) -> str:
    """Advance rollout ``rollout_id`` once; with ``step_index`` only if it is still at that step.

    Returns what happened: ``skipped`` (not progressing there: a duplicate delivery, or aborted),
    ``not-due``, ``waiting``, a step kind, ``analysis``, ``promoted``, ``aborted``, ``failed``, ...
    """
    now = now or timezone.now()
    with transaction.atomic():
        qs = RolloutPlan.objects.select_for_update().filter(pk=rollout_id)
        if step_index is not None:
            qs = qs.filter(current_step_index=step_index)
        plan = qs.first()
        if plan is None:
            return "skipped"
        cleanup = plan.state in (transitions.ABORTED, transitions.FAILED) and plan.progress.get("cleanup")
        if plan.state != transitions.PROGRESSING and not cleanup:
            return "skipped"
        if plan.next_step_at is not None and plan.next_step_at > now:
            return "not-due"
        blue_green = plan.strategy == RolloutPlan.Strategy.BLUE_GREEN
        try:
            if cleanup:
                result = (bluegreen.cleanup if blue_green else canary_cleanup)(plan, now)
            else:
                plan.message = ""  # each tick says what holds the rollout now; no stale "Waiting for ..."
                result = (bluegreen.tick if blue_green else canary_tick)(plan, now)
                if not plan.message:
                    plan.message = status_text(plan)
        except RolloutFailure as exc:
            kind = "rollout.abort" if exc.event == "gate_abort" else "rollout.fail"
            revert(plan, event=exc.event, reason=exc.reason, kind=kind, now=now)
            result = plan.state
        plan.save()
    return result
