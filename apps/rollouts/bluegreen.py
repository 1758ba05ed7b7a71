"""Blue-green ticks: preview at full size, readiness, smoke test, steps and gates, switch, scale-down delay.

Phases (``RolloutPlan.Phase``) of a progressing blue-green rollout; the old active track (``stable``,
``blue`` or ``green``) keeps serving until the switch, the preview is the other colour:

1. ``preview``: the preview track (with the plan's ``worker_args`` as its worker options; it keeps
   them after promotion) gets the pool total ``R`` replicas, inactive, weight 0; wait
   until all ``R`` are ready in every pool (``progress_deadline_s``, else the rollout fails).
2. ``smoke``: a real completion (``POST /v1/completions``, 4 tokens) through a ready preview
   replica of every serving pool; an error fails the rollout.
3. ``steps``: the plan's ``pause``/``analysis`` steps (gates measured on the preview track).
4. ``switched``: preview active at weight 100, old inactive at 0; a ``pool.switch_active`` Action per
   pool has the backend move the pool Service to the preview (Kubernetes; the local backend answers that
   the routing table does it), run right after the tick's transaction; wait for it and for the router to
   apply the table; keep the old track at ``R`` replicas for ``scale_down_delay_s`` — an abort now
   switches straight back to it without restarting anything.
5. After the delay, once the new tracks have all ``R`` replicas ready again (one may have died since the switch)
   and the router applied the table listing them, the old track is removed and the pools' version becomes the
   target: ``promoted``.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx

from apps.core.errors import ConflictError
from apps.fleet.models import PoolTrack
from apps.operations.models import Action
from apps.operations.services import action_cancel
from apps.operations.tracks import switch_outcome
from apps.rollouts import transitions
from apps.rollouts.desired import (
    PoolView,
    pool_views,
    publish,
    ready_endpoints,
    record_action,
    step_action_log,
    switch_request,
    track_delete,
    track_ensure,
    track_write,
)
from apps.rollouts.models import RolloutPlan
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
from apps.rollouts.traffic import publish_if_changed, replicas_text, router_behind, scale_down_hold

Phase = RolloutPlan.Phase
SMOKE_PROMPT = "The capital of France is"


def preview_name(active: str) -> str:
    """The preview colour for an active track: ``blue`` when ``green`` serves, else ``green``."""
    return PoolTrack.Name.BLUE if active == PoolTrack.Name.GREEN else PoolTrack.Name.GREEN


def _names(plan: RolloutPlan, view: PoolView) -> tuple[str, str]:
    prog = plan.typed_progress
    return prog.stable_tracks[view.key], prog.new_tracks[view.key]


def bluegreen_mode(plan: RolloutPlan, *, done: bool = False) -> str:
    """What the converge aims at, from ``phase``: ``preview`` (preview, smoke, steps), ``switched``,
    ``revert`` (reverting); ``done`` (the promoting tick) when asked."""
    if done:
        return "done"
    return {Phase.SWITCHED: "switched", Phase.REVERTING: "revert"}.get(plan.phase, "preview")


def _wanted(mode: str, view: PoolView, old: str, new: str) -> dict[str, dict]:
    new_serves = mode in ("switched", "done")
    return {old: {"replicas": 0 if mode == "done" else view.total, "active": not new_serves,
                  "weight": 0 if new_serves else 100},
            new: {"replicas": 0 if mode == "revert" else view.total, "active": new_serves,
                  "weight": 100 if new_serves else 0}}


def converge(plan: RolloutPlan, views: list[PoolView], *, done: bool = False) -> list[str]:
    """Write desired replicas, active flags and weights for the mode of :func:`bluegreen_mode`; returns
    change lines.

    Modes: ``preview`` (both at R, old active), ``switched`` (both at R, preview active), ``done``
    (old at 0, preview active), ``revert`` (old at R and active, preview at 0). Traffic leaves a track
    before its replicas do: a track losing replicas keeps them until the router reports the table that
    moved its traffic (:func:`apps.rollouts.traffic.scale_down_hold`), e.g. a switch-back sends
    traffic to the old track first and stops the preview once the router applied that.
    """
    mode, lines = bluegreen_mode(plan, done=done), []
    shrinks: list[tuple[PoolView, PoolTrack, int]] = []
    weights_changed = False
    for view in views:
        for name, values in _wanted(mode, view, *_names(plan, view)).items():
            track = view.tracks.get(name)
            if track is None:
                continue
            replicas = values["replicas"]
            if replicas < track.replicas:
                shrinks.append((view, track, replicas))
                replicas = track.replicas
            routing = {"active": values["active"], "weight": values["weight"]}
            weights_changed |= any(getattr(track, f) != v for f, v in routing.items())
            if track_write(plan, track, replicas=replicas, **routing):
                lines.append(f"{view.pool}: {name} replicas {replicas}, "
                             f"{'active' if values['active'] else 'inactive'}, weight {values['weight']}%")
    held = scale_down_hold(plan, weights_changed=weights_changed) if shrinks else None
    for view, track, replicas in shrinks:
        before = track.replicas
        if held is None and track_write(plan, track, replicas=replicas):
            lines.append(f"{view.pool}: {track.name} replicas {before} -> {replicas}")
    plan.typed_progress.scale_down_held = held
    return lines


def smoke_test(endpoint: str, *, worker_token: str = "", timeout_s: float = 60.0) -> tuple[bool, str]:
    """A real completion through ``endpoint`` (OpenAI API of a worker), sent with its pool's ``worker_token``
    (``Authorization: Bearer``; "" sends none); ``(passed, detail)``."""
    base = endpoint.rstrip("/")
    headers = {"Authorization": f"Bearer {worker_token}"} if worker_token else {}
    try:
        with httpx.Client(timeout=timeout_s, headers=headers) as client:
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
            response = client.post(f"{base}/v1/completions", json={
                "model": model, "prompt": SMOKE_PROMPT, "max_tokens": 4, "temperature": 0})
            body = response.json()
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        return False, f"smoke test at {base} failed: {type(exc).__name__}: {exc}"
    choices = body.get("choices") if isinstance(body, dict) else None
    tokens = (body.get("usage") or {}).get("completion_tokens", 0) if isinstance(body, dict) else 0
    if response.status_code != 200 or not choices or not isinstance(choices[0].get("text"), str) or tokens < 1:
        return False, f"smoke test at {base}: HTTP {response.status_code}: {str(body)[:200]}"
    return True, f"smoke test at {base}: {tokens} tokens {choices[0]['text']!r}"


def _switch_state(plan: RolloutPlan, view: PoolView, target: str) -> tuple[Action | None, str | None]:
    """The newest switch Action of ``view``'s pool and, when it must be requested again, why (or None)."""
    action_id = plan.typed_progress.switch_actions.get(view.key)
    action = Action.objects.filter(pk=action_id).first() if action_id else None
    if action is None or action.params.get("track") != target:
        return action, ""
    if action.status in (Action.Status.FAILED, Action.Status.CANCELLED):
        return action, f" (action #{action.pk} {action.status}: {action.error or 'no error recorded'})"
    return action, None


def switch_services(plan: RolloutPlan, views: list[PoolView], *, to_new: bool) -> str | None:
    """Have the backend's ``switch_active`` run for every pool (to the preview, or back to the old track).

    Each pool's switch is a ``pool.switch_active`` Action (:func:`apps.rollouts.desired.switch_request`), run
    right after the tick's transaction; a later tick reads its outcome. Done pools are kept in
    ``progress.switched_services`` so a retry skips them; a failed Action is requested again (a backend error:
    retried on the next tick until the progress deadline). Returns None when every pool switched, else what it
    waits for.
    """
    prog, waiting = plan.typed_progress, []
    for view in views:
        old, new = _names(plan, view)
        target = new if to_new else old
        if prog.switched_services.get(view.key) == target:
            continue
        action, again = _switch_state(plan, view, target)
        if again is not None:
            if action is not None and action.status == Action.Status.PENDING:
                try:  # a switch the other way that has not run yet must not run after this one
                    action_cancel(action=action)
                except ConflictError:
                    pass
            action = switch_request(plan, view, target)
            prog.switch_actions[view.key] = action.pk
            waiting.append(f"{view.pool}: switch_active({target}) (action #{action.pk}){again}")
        elif action.status == Action.Status.SUCCEEDED:
            prog.switched_services[view.key] = target
            step_action_log(plan, f"{view.pool}: {switch_outcome(action)}")
        else:
            waiting.append(f"{view.pool}: switch_active({target}) (action #{action.pk} {action.status})")
    return "; ".join(waiting) or None


def _preview_ready(plan: RolloutPlan, views: list[PoolView], now: datetime) -> str | None:
    """Phase ``preview``: what the full-size preview still waits for (None: every pool's preview is ready)."""
    for view in views:
        _, new = _names(plan, view)
        ready = min(view.ready.get(new, 0), view.tracks[new].replicas)
        if ready < view.total:
            waiting = f"{view.pool} preview {new}: {ready} of {replicas_text(view.total)} ready"
            check_deadline(plan, now, waiting)
            return waiting
    return None


def _smoke(plan: RolloutPlan, views: list[PoolView]) -> None:
    """Phase ``smoke``: a completion through a ready preview replica of every serving pool (raises
    RolloutFailure on an error)."""
    lines = []
    for view in [v for v in views if v.serving]:
        endpoints = ready_endpoints(view, _names(plan, view)[1])
        passed, detail = (smoke_test(endpoints[0], worker_token=view.pool.worker_token) if endpoints
                          else (False, f"{view.pool}: no preview endpoint"))
        if not passed:
            raise RolloutFailure("fail", detail)
        lines.append(detail)
    record_action(plan, "rollout.step", lines or ["no serving pool to smoke test"], params={"phase": "smoke"})


def _steps(plan: RolloutPlan, views: list[PoolView], now: datetime) -> str | None:
    """Phase ``steps``: the running analysis, then the next pause/analysis step; None once all are done."""
    if plan.typed_progress.analysis is not None:
        stable = {v.pool.pk: _names(plan, v)[0] for v in views}
        new = _names(plan, views[0])[1] if views else PoolTrack.Name.GREEN
        if not analysis_tick(plan, views, now, new_track=new, stable_tracks=stable):
            return "analysis"
    index = plan.current_step_index
    if index >= len(plan.steps):
        return None
    if not claim_step(plan, index):
        return "skipped"
    (kind, arg), = plan.steps[index].items()
    lines = [step_label(plan, index)]
    outcome = apply_pause_or_analysis(plan, index, kind, arg, now, lines)
    record_action(plan, "rollout.step", lines, params={"step_index": index, "step": plan.steps[index]},
                  idempotency_key=f"rollout-{plan.pk}-step-{index}")
    return outcome


def _switch(plan: RolloutPlan, views: list[PoolView], now: datetime) -> str:
    """Preview active at weight 100, old inactive at 0; the backends' switches are requested."""
    plan.phase, plan.step_started_at = Phase.SWITCHED, now
    lines = converge(plan, views)
    publish_if_changed(plan, lines)
    record_action(plan, "rollout.step", ["switch active to the preview", *lines], params={"phase": "switch"})
    switch_services(plan, views, to_new=True)
    schedule(plan, now, 0)
    return "switched"


def _promote(plan: RolloutPlan, views: list[PoolView]) -> str:
    """After the scale-down delay: the old tracks go, the pools run the target version."""
    lines = converge(plan, views, done=True)
    for view in views:
        track_delete(plan, view, _names(plan, view)[0])
        type(view.pool).objects.filter(pk=view.pool.pk).update(model_version=plan.target_model_version)
    lines.append(f"old tracks removed; routing table v{publish()}")
    plan.state = transitions.next_state("complete", plan.state, name=plan.name)
    plan.phase, plan.next_step_at = Phase.NONE, None
    plan.message = completed_message(plan)
    record_action(plan, "rollout.complete", [plan.message, *lines])
    return "promoted"


def _wait(plan: RolloutPlan, now: datetime, waiting: str) -> str:
    plan.message = f"Waiting for {waiting_text(plan, waiting)}."
    schedule(plan, now)
    return "waiting"


def tick(plan: RolloutPlan, now: datetime) -> str:
    """One blue-green tick (module docstring). Raises RolloutFailure to fail or abort."""
    views = pool_views(plan)
    changes = converge(plan, views)
    publish_if_changed(plan, changes)
    if changes:
        step_action_log(plan, "; ".join(changes))
    if plan.phase == Phase.PREVIEW:
        waiting = _preview_ready(plan, views, now)
        if waiting is not None:
            return _wait(plan, now, waiting)
        plan.phase, plan.step_started_at = Phase.SMOKE, now
    if plan.phase == Phase.SMOKE:
        _smoke(plan, views)
        plan.phase, plan.step_started_at = Phase.STEPS, now
    if plan.phase == Phase.STEPS:
        return _steps(plan, views, now) or _switch(plan, views, now)
    behind = switch_services(plan, views, to_new=True) or router_behind(plan)
    if behind is not None:
        check_deadline(plan, now, behind)
        return _wait(plan, now, behind)
    prog = plan.typed_progress
    if prog.switched_at is None:
        prog.switched_at = now
        plan.message = f"Switched; the old track stays for {plan.scale_down_delay_s}s for an instant switch-back."
        schedule(plan, now, plan.scale_down_delay_s)
        return "scale-down-delay"
    delay_end = prog.switched_at + timedelta(seconds=plan.scale_down_delay_s)
    if plan.step_started_at is None or plan.step_started_at < delay_end:
        plan.step_started_at = now  # the wait below counts toward the progress deadline from the delay's end
    waiting = _new_tracks_ready(plan, views)
    if waiting is not None:
        check_deadline(plan, now, waiting)
        return _wait(plan, now, waiting)
    return _promote(plan, views)


def _new_tracks_ready(plan: RolloutPlan, views: list[PoolView]) -> str | None:
    """After the scale-down delay: what the new tracks still lack before the old ones may go (None: every pool's
    new track has its ``R`` replicas ready again, as at the switch, and the router applied the table that lists
    them). A new replica that died after the switch is being restarted: removing the old track then left no
    ready replica of the model at all, and clients got 503 until the restart (chaos matrix, blue-green x
    model:new); while the old track stays, the router fails its traffic over to it."""
    for view in views:
        _, new = _names(plan, view)
        ready = min(view.ready.get(new, 0), view.tracks[new].replicas)
        if ready < view.total:
            return f"{view.pool} {new}: {ready} of {replicas_text(view.total)} ready before the old track goes"
    prog = plan.typed_progress
    prog.await_version = max(prog.await_version or 0, publish())
    return router_behind(plan)


def revert_switch(plan: RolloutPlan, views: list[PoolView]) -> None:
    """An abort or failure after a switch was requested: request the switch back to the old tracks now."""
    if plan.typed_progress.switch_actions:
        switch_services(plan, views, to_new=False)


def cleanup(plan: RolloutPlan, now: datetime) -> str:
    """After an abort/failure: once the old track serves again and the router no longer sends traffic to
    the preview (its replicas went to 0, see :func:`converge`), remove the preview track."""
    views = pool_views(plan)
    publish_if_changed(plan, converge(plan, views))
    if any(v.tracks[_names(plan, v)[1]].replicas for v in views if _names(plan, v)[1] in v.tracks):
        schedule(plan, now)
        return "reverting"
    if plan.typed_progress.switch_actions and switch_services(plan, views, to_new=False) is not None:
        schedule(plan, now)
        return "reverting"
    for view in views:
        old, _ = _names(plan, view)
        if min(view.ready.get(old, 0), view.tracks[old].replicas) < 1:
            schedule(plan, now)
            return "reverting"
    for view in views:
        track_delete(plan, view, _names(plan, view)[1])
    version = publish()
    plan.typed_progress.cleanup = False
    plan.phase, plan.next_step_at = Phase.NONE, None  # no longer reverting: the cleanup is done
    step_action_log(plan, f"reverted: preview tracks removed (routing table v{version})")
    return "reverted"


def start(plan: RolloutPlan, views: list[PoolView]) -> list[str]:
    """Create the preview tracks (called by ``rollout_start``); returns change lines."""
    prog = plan.typed_progress
    prog.new_tracks = {}
    for view in views:
        new = preview_name(prog.stable_tracks[view.key])
        if new in view.tracks:
            raise RolloutFailure("fail", f"pool {view.pool} already has a {new} track; remove it first")
        track_ensure(plan, view, new, plan.target_model_version, active=False, extra_args=plan.worker_args)
        prog.new_tracks[view.key] = new
    plan.phase = Phase.PREVIEW
    return converge(plan, views)
