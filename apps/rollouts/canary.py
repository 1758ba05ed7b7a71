"""Canary ticks: converge the current target, wait until it is settled, apply the next step, finalize.

Per tick of a progressing plan (plan row locked, see :mod:`apps.rollouts.steps`):

1. **Converge** the current target (``phase`` and ``progress.weight``): per pool, the split of
   :func:`replica_math.canary_split` reached by surge-limited moves (:func:`replica_math.next_replicas`),
   and the canary weight that may be published now (:func:`replica_math.applied_weight`: no traffic
   to a track with zero ready replicas; prefill/decode kept within ``max_weight_skew``). A change
   publishes the routing table and the plan waits for the router to report that version. No pool's
   track loses its last replica while its model version still has weight (:func:`traffic_floor`),
   and a shrinking track keeps its replicas until the router applied the table
   (:func:`apps.rollouts.traffic.scale_down_hold`).
2. Not settled yet (replicas not ready, weight not reached, router behind) -> wait, unless the step is
   older than ``progress_deadline_s``: then the rollout fails and traffic returns to stable.
3. Settled: a running analysis is evaluated; else the next step is applied (claimed by index).
   After the last step the weight goes to 100 (a plan whose last weight is below 100 still ends
   at 100%), then **finalize** (phase ``finalizing``): the stable track takes the new version and the
   plan's ``worker_args`` (the new release's worker options) and the replicas move back from ``canary``
   to it, the canary track is removed and the rollout is ``promoted``.

Abort and failure (phase ``reverting``) put traffic back on stable at once when stable has a ready replica,
and keep converging (``progress.cleanup``) until the canary track is gone. Every track change goes through
:mod:`apps.rollouts.desired` (one ``pool.*`` Action each).
"""

from __future__ import annotations

from datetime import datetime

from apps.rollouts import transitions
from apps.rollouts.desired import (
    PoolView,
    pool_views,
    publish,
    record_action,
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
    completed_message,
    schedule,
    step_label,
    waiting_text,
)
from apps.rollouts.traffic import (
    publish_if_changed,
    ready_count,
    replicas_text,
    router_behind,
    scale_down_hold,
)

NEW_TRACK = "canary"
Phase = RolloutPlan.Phase
Shrink = tuple[PoolView, str, int, int]
"""``(view, track name, replicas before, replicas after)`` of a track that loses replicas."""


def canary_mode(plan: RolloutPlan) -> str:
    """What the converge aims at: ``canary`` (the step's split), ``finalize`` or ``revert`` (from ``phase``)."""
    return {Phase.FINALIZING: "finalize", Phase.REVERTING: "revert"}.get(plan.phase, "canary")


def canary_targets(plan: RolloutPlan, view: PoolView) -> dict[str, int]:
    """Desired replicas per track for the plan's current mode (raises ReplicaMathError)."""
    prog = plan.typed_progress
    stable = prog.stable_tracks[view.key]
    if canary_mode(plan) == "canary":
        canary, kept = canary_split(view.total, prog.weight, max_surge=plan.max_surge)
        return {stable: kept, NEW_TRACK: canary}
    return {stable: view.total, NEW_TRACK: 0}


def _grow(plan: RolloutPlan, views: list[PoolView], lines: list[str]) -> tuple[dict, list[Shrink], bool]:
    """Write the growing tracks' next replicas at once; returns the planned replicas per pool and track, the
    shrinks (written later, after the weights) and whether anything grew."""
    planned: dict[str, dict[str, int]] = {}
    shrinks: list[Shrink] = []
    grew = False
    for view in views:
        if NEW_TRACK not in view.tracks:
            continue
        target = canary_targets(plan, view)
        desired = {name: view.tracks[name].replicas for name in target}
        ready = {name: ready_count(view, name) for name in target}
        moved = next_replicas(desired=desired, ready=ready, target=target, total=view.total,
                              max_surge=plan.max_surge)
        planned[view.key] = moved
        for name, replicas in moved.items():
            if replicas < desired[name]:
                shrinks.append((view, name, desired[name], replicas))
            elif track_write(plan, view.tracks[name], replicas=replicas):
                grew = True
                lines.append(f"{view.pool}: {name} replicas {desired[name]} -> {replicas}")
    return planned, shrinks, grew


def _weight(plan: RolloutPlan, views: list[PoolView], planned: dict) -> tuple[int, int]:
    """The canary weight that may be served after this move, and the serving pools' ready canary replicas."""
    prog, mode = plan.typed_progress, canary_mode(plan)

    def ready_after(view: PoolView, name: str) -> int:
        return min(view.ready.get(name, 0), planned[view.key].get(name, 0))

    with_canary = [v for v in views if NEW_TRACK in v.tracks]
    serving = [v for v in with_canary if v.serving] or with_canary
    ready_new = sum(ready_after(v, NEW_TRACK) for v in serving)
    ready_stable = sum(ready_after(v, prog.stable_tracks[v.key]) for v in serving)
    previous = prog.applied_weight
    if mode == "canary":
        shares = {v.key: (ready_after(v, NEW_TRACK), canary_targets(plan, v)[NEW_TRACK]) for v in with_canary}
        weight = applied_weight(weight=prog.weight, previous=previous, shares=shares,
                                skew=plan.max_weight_skew, serving_ready=ready_new)
    elif mode == "finalize":  # both tracks run the new version: split by ready replicas
        weight = previous if ready_new + ready_stable == 0 else round(100 * ready_new / (ready_new + ready_stable))
    else:  # revert: back to stable as soon as it can serve
        weight = 0 if ready_stable > 0 else previous
    return weight, ready_new


def _unblock_without_surge(plan: RolloutPlan, shrinks: list[Shrink], kept: list[Shrink], weight: int,
                           ready_new: int) -> tuple[list[Shrink], int]:
    """No surge room and the only move left removes the last replica of a track that still has traffic
    (Kubernetes' maxUnavailable = 1): move the traffic first, then the replica goes."""
    prog = plan.typed_progress
    if canary_mode(plan) == "canary" and ready_new > 0 and weight < prog.weight:
        weight = prog.weight
        kept = traffic_floor(plan, shrinks, weight)
    if all(after == before for _, _, before, after in kept):
        kept = shrinks  # nothing else can move: a replica has to go while its traffic is still there
    return kept, weight


def _write_weights(plan: RolloutPlan, views: list[PoolView], weight: int) -> bool:
    changed = False
    for view in views:
        if NEW_TRACK in view.tracks:
            changed |= track_write(plan, view.tracks[NEW_TRACK], weight=weight)
            changed |= track_write(plan, view.tracks[plan.typed_progress.stable_tracks[view.key]],
                                   weight=100 - weight)
    return changed


def _floor_held(shrinks: list[Shrink], kept: list[Shrink], weight: int) -> str | None:
    """Why a shrink stopped above its target: a track whose version still has traffic keeps one replica."""
    floored = [(view, name) for (view, name, _, wanted), (*_, after) in zip(shrinks, kept, strict=True)
               if after > wanted]
    if not floored:
        return None
    view, name = floored[0]
    share = weight if name == NEW_TRACK else 100 - weight
    return (f"{view.pool} {name} to lose its traffic before its last replica stops "
            f"({view.tracks[name].model_version} still gets {share}%)")


def canary_converge(plan: RolloutPlan, views: list[PoolView]) -> list[str]:
    """Write the next desired replicas and weights of every pool; returns lines describing changes.

    Traffic leaves a track before its replicas do: the weights are computed from the replica counts after
    this move, then a shrinking track keeps the replicas its traffic still needs (:func:`traffic_floor`,
    for every pool: a prefill pool's track serves the decode traffic of its model version), and it keeps
    them all until the router reports the routing table that takes the traffic away
    (:func:`scale_down_hold`); growing tracks move at once.
    """
    prog, lines = plan.typed_progress, []
    planned, shrinks, grew = _grow(plan, views, lines)
    weight, ready_new = _weight(plan, views, planned)
    kept = traffic_floor(plan, shrinks, weight)
    if plan.max_surge == 0 and not grew and kept and all(after == before for _, _, before, after in kept):
        kept, weight = _unblock_without_surge(plan, shrinks, kept, weight, ready_new)
    previous, prog.applied_weight = prog.applied_weight, weight
    changed = _write_weights(plan, views, weight)
    if changed and canary_mode(plan) == "finalize":  # both tracks run the target: the split is capacity, not risk
        lines.append(f"canary weight {previous}% -> {weight}% (by ready replicas: both tracks run "
                     f"{plan.target_model_version}, which keeps all the traffic)")
    elif changed:
        lines.append(f"canary weight {previous}% -> {weight}%")
    held = scale_down_hold(plan, weights_changed=changed) if kept else None
    for view, name, before, after in kept:
        if held is None and track_write(plan, view.tracks[name], replicas=after):
            lines.append(f"{view.pool}: {name} replicas {before} -> {after}")
    if held is None:
        held = _floor_held(shrinks, kept, weight)
    prog.scale_down_held = held
    return lines


def traffic_floor(plan: RolloutPlan, shrinks: list[Shrink], weight: int) -> list[Shrink]:
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
        stable = plan.typed_progress.stable_tracks[view.key]
        other = stable if name == NEW_TRACK else NEW_TRACK
        share = weight if name == NEW_TRACK else 100 - weight
        same_version = view.tracks[other].model_version_id == view.tracks[name].model_version_id
        if share > 0 and after == 0 and not same_version:
            after = min(before, 1)
        out.append((view, name, before, after))
    return out


def _track_waits(plan: RolloutPlan, view: PoolView, name: str, want: int) -> str | None:
    track = view.tracks[name]
    if track.replicas > want and plan.typed_progress.scale_down_held:
        return plan.typed_progress.scale_down_held
    if track.replicas > want:
        return (f"{view.pool} {name}: {replicas_text(track.replicas)}, going to {want} once the "
                "replacements are ready")
    if track.replicas < want or ready_count(view, name) < want:
        started = "" if track.replicas == want else f", {track.replicas} started"
        return f"{view.pool} {name}: {ready_count(view, name)} of {replicas_text(want)} ready{started}"
    if want == 0 and name != NEW_TRACK and view.alive.get(name, 0):  # stable empty before it changes version
        return f"{view.pool} {name}: {replicas_text(view.alive[name])} still running (desired 0)"
    return None


def canary_settled(plan: RolloutPlan, views: list[PoolView]) -> str | None:
    """What the current target still waits for (None: replicas ready, weight reached, router caught up)."""
    prog = plan.typed_progress
    for view in views:
        if NEW_TRACK not in view.tracks:
            continue
        for name, want in sorted(canary_targets(plan, view).items()):
            waiting = _track_waits(plan, view, name, want)
            if waiting is not None:
                return waiting
    wanted = prog.weight if canary_mode(plan) == "canary" else 0
    if prog.applied_weight != wanted:
        return f"canary weight {prog.applied_weight}% (target {wanted}%)"
    return router_behind(plan)


def _apply_canary_step(plan: RolloutPlan, views: list[PoolView], index: int, now: datetime) -> str:
    if not claim_step(plan, index):
        return "skipped"
    (kind, arg), = plan.steps[index].items()
    lines = [step_label(plan, index)]
    plan.step_started_at = now
    outcome = kind
    if kind == "set_weight":
        plan.typed_progress.weight = arg
        changes = canary_converge(plan, views)
        publish_if_changed(plan, changes)
        lines += changes
        schedule(plan, now, 0)
    else:
        outcome = apply_pause_or_analysis(plan, index, kind, arg, now, lines)
    record_action(plan, "rollout.step", lines, params={"step_index": index, "step": plan.steps[index]},
                  idempotency_key=f"rollout-{plan.pk}-step-{index}")
    return outcome


def _finish(plan: RolloutPlan, views: list[PoolView]) -> str:
    for view in views:
        track_delete(plan, view, NEW_TRACK)
        type(view.pool).objects.filter(pk=view.pool.pk).update(model_version=plan.target_model_version)
    version = publish()
    plan.state = transitions.next_state("complete", plan.state, name=plan.name)
    plan.phase, plan.next_step_at = Phase.NONE, None
    plan.message = completed_message(plan)
    record_action(plan, "rollout.complete", [plan.message, f"routing table v{version}"])
    return "promoted"


def _after_last_step(plan: RolloutPlan, views: list[PoolView], now: datetime) -> str:
    """All steps done: the weight goes to 100, then the stable tracks take the new version (finalize)."""
    prog = plan.typed_progress
    plan.step_started_at = now
    if prog.weight != 100:
        prog.weight = 100
        lines = ["all steps done: canary weight to 100%"]
    else:
        plan.phase = Phase.FINALIZING
        for view in views:
            track_write(plan, view.tracks[prog.stable_tracks[view.key]], model_version=plan.target_model_version,
                        extra_args=plan.worker_args)
        lines = [f"finalize: stable tracks move to {plan.target_model_version}"
                 + (f" with worker options {plan.worker_args!r}" if plan.worker_args else "")]
    lines += canary_converge(plan, views)
    publish_if_changed(plan, lines)
    record_action(plan, "rollout.step", lines, params={"phase": canary_mode(plan), "weight": prog.weight})
    schedule(plan, now, 0)
    return "finalizing" if plan.phase == Phase.FINALIZING else "to-100"


def canary_tick(plan: RolloutPlan, now: datetime) -> str:
    """One canary tick (module docstring). Raises RolloutFailure to abort or fail."""
    views = pool_views(plan)
    prog = plan.typed_progress
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
        plan.message = f"Waiting for {waiting_text(plan, waiting)}."
        schedule(plan, now)
        return "waiting"
    if plan.phase == Phase.FINALIZING:
        return _finish(plan, views)
    if prog.analysis is not None:
        stable_tracks = {v.pool.pk: prog.stable_tracks[v.key] for v in views}
        if not analysis_tick(plan, views, now, new_track=NEW_TRACK, stable_tracks=stable_tracks):
            return "analysis"
    index = plan.current_step_index
    if index < len(plan.steps):
        return _apply_canary_step(plan, views, index, now)
    return _after_last_step(plan, views, now)


def canary_cleanup(plan: RolloutPlan, now: datetime) -> str:
    """Converge an aborted/failed canary back to stable; remove the canary track once it is safe."""
    views = pool_views(plan)
    changes = canary_converge(plan, views)
    publish_if_changed(plan, changes)
    if canary_settled(plan, views) is not None:
        schedule(plan, now)
        return "reverting"
    for view in views:
        track_delete(plan, view, NEW_TRACK)
    version = publish()
    plan.typed_progress.cleanup = False
    plan.phase, plan.next_step_at = Phase.NONE, None  # no longer reverting: the cleanup is done
    step_action_log(plan, f"reverted: canary tracks removed (routing table v{version})")
    return "reverted"
