"""Blue-green ticks: preview at full size, readiness, smoke test, steps and gates, switch, scale-down delay.

Phases (``RolloutPlan.phase``) of a progressing blue-green rollout; the old active track (``stable``,
``blue`` or ``green``) keeps serving until the switch, the preview is the other colour:

1. ``preview``: the preview track (with the plan's ``worker_args`` as its worker options; it keeps
   them after promotion) gets the pool total ``R`` replicas, inactive, weight 0; wait
   until all ``R`` are ready in every pool (``progress_deadline_s``, else the rollout fails).
2. ``smoke``: a real completion (``POST /v1/completions``, 4 tokens) through a ready preview
   replica of every serving pool; an error fails the rollout.
3. ``steps``: the plan's ``pause``/``analysis`` steps (gates measured on the preview track).
4. ``switched``: preview active at weight 100, old inactive at 0; the backend's ``switch_active``
   moves the pool Service to the preview (Kubernetes; the local backend answers that the routing
   table does it); wait for the router to apply the table; keep the old track at ``R`` replicas for ``scale_down_delay_s`` — an abort now switches
   straight back to it without restarting anything.
5. After the delay the old track is removed, the pools' version becomes the target: ``promoted``.
"""

from __future__ import annotations

import logging
from datetime import datetime

import httpx

from apps.fleet.models import PoolTrack
from apps.operations.backends import backend_session, pool_ref
from apps.orchestrators.base import BackendError
from apps.rollouts import transitions
from apps.rollouts.desired import (
    PoolView,
    pool_views,
    publish,
    ready_endpoints,
    record_action,
    step_action_log,
    track_delete,
    track_write,
)
from apps.rollouts.models import RolloutPlan
from apps.rollouts.steps import (
    RolloutFailure,
    analysis_tick,
    apply_pause_or_analysis,
    check_deadline,
    claim_step,
    schedule,
    step_label,
)

SMOKE_PROMPT = "The capital of France is"
logger = logging.getLogger(__name__)


def preview_name(active: str) -> str:
    """The preview colour for an active track: ``blue`` when ``green`` serves, else ``green``."""
    return PoolTrack.Name.BLUE if active == PoolTrack.Name.GREEN else PoolTrack.Name.GREEN


def _names(plan: RolloutPlan, view: PoolView) -> tuple[str, str]:
    return plan.progress["stable_tracks"][view.key], plan.progress["new_tracks"][view.key]


def converge(plan: RolloutPlan, views: list[PoolView]) -> list[str]:
    """Write desired replicas, active flags and weights for ``progress.mode``; returns change lines.

    Modes: ``preview`` (both at R, old active), ``switched`` (both at R, preview active), ``done``
    (old at 0, preview active), ``revert`` (old at R and active, preview at 0). Traffic leaves a track
    before its replicas do: a track losing replicas keeps them until the router reports the table that
    moved its traffic (:func:`apps.rollouts.controller.scale_down_hold`), e.g. a switch-back sends
    traffic to the old track first and stops the preview once the router applied that.
    """
    from apps.rollouts.controller import scale_down_hold

    mode, lines = plan.progress["mode"], []
    shrinks: list[tuple[PoolView, PoolTrack, int]] = []
    weights_changed = False
    for view in views:
        old, new = _names(plan, view)
        new_serves = mode in ("switched", "done")
        wanted = {old: {"replicas": 0 if mode == "done" else view.total, "active": not new_serves,
                        "weight": 0 if new_serves else 100},
                  new: {"replicas": 0 if mode == "revert" else view.total, "active": new_serves,
                        "weight": 100 if new_serves else 0}}
        for name, values in wanted.items():
            track = view.tracks.get(name)
            if track is None:
                continue
            replicas = values["replicas"]
            if replicas < track.replicas:
                shrinks.append((view, track, replicas))
                replicas = track.replicas
            routing = {"active": values["active"], "weight": values["weight"]}
            weights_changed |= any(getattr(track, f) != v for f, v in routing.items())
            if track_write(track, replicas=replicas, **routing):
                lines.append(f"{view.pool}: {name} replicas {replicas}, "
                             f"{'active' if values['active'] else 'inactive'}, weight {values['weight']}%")
    held = scale_down_hold(plan, weights_changed=weights_changed) if shrinks else None
    for view, track, replicas in shrinks:
        before = track.replicas
        if held is None and track_write(track, replicas=replicas):
            lines.append(f"{view.pool}: {track.name} replicas {before} -> {replicas}")
    if held is not None:
        plan.progress["scale_down_held"] = held
    else:
        plan.progress.pop("scale_down_held", None)
    return lines


def smoke_test(endpoint: str, *, timeout_s: float = 60.0) -> tuple[bool, str]:
    """A real completion through ``endpoint`` (OpenAI API of a worker); ``(passed, detail)``."""
    base = endpoint.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as client:
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


def switch_services(plan: RolloutPlan, views: list[PoolView], *, to_new: bool) -> str | None:
    """Call the backend's ``switch_active`` for every pool (to the preview, or back to the old track).

    Records done pools in ``progress.switched_services`` so a retry skips them. Returns None when
    every pool switched, else what failed (a backend error: retried on the next tick).
    """
    done = plan.progress.setdefault("switched_services", {})
    for view in views:
        old, new = _names(plan, view)
        target = new if to_new else old
        if done.get(view.key) == target:
            continue
        try:
            with backend_session(view.pool.cluster) as backend:
                how = backend.switch_active(pool_ref(view.pool), target)
        except BackendError as exc:
            logger.warning("rollout %s: switch_active(%s, %s) failed: %s", plan.pk, view.pool, target, exc)
            return f"{view.pool}: switch_active({target}) failed: {type(exc).__name__}: {exc}"
        done[view.key] = target
        step_action_log(plan, f"{view.pool}: switch_active({target}) -> {how}")
    return None


def _publish(plan: RolloutPlan, lines: list[str]) -> None:
    from apps.rollouts.controller import publish_if_changed

    publish_if_changed(plan, lines)


def tick(plan: RolloutPlan, now: datetime) -> str:
    """One blue-green tick (module docstring). Raises RolloutFailure to fail or abort."""
    from apps.rollouts.controller import replicas_text, router_behind

    views = pool_views(plan)
    changes = converge(plan, views)
    _publish(plan, changes)
    if changes:
        step_action_log(plan, "; ".join(changes))
    if plan.phase == "preview":
        for view in views:
            _, new = _names(plan, view)
            ready = min(view.ready.get(new, 0), view.tracks[new].replicas)
            if ready < view.total:
                waiting = f"{view.pool} preview {new}: {ready} of {replicas_text(view.total)} ready"
                check_deadline(plan, now, waiting)
                plan.message = f"Waiting for {waiting}."
                schedule(plan, now)
                return "waiting"
        plan.phase, plan.step_started_at = "smoke", now
    if plan.phase == "smoke":
        lines = []
        for view in [v for v in views if v.serving]:
            endpoints = ready_endpoints(view, _names(plan, view)[1])
            passed, detail = smoke_test(endpoints[0]) if endpoints else (False, f"{view.pool}: no preview endpoint")
            if not passed:
                raise RolloutFailure("fail", detail)
            lines.append(detail)
        record_action(plan, "rollout.step", lines or ["no serving pool to smoke test"], params={"phase": "smoke"})
        plan.phase, plan.step_started_at = "steps", now
    if plan.phase == "steps":
        if plan.progress.get("analysis"):
            stable = {v.pool.pk: _names(plan, v)[0] for v in views}
            new = _names(plan, views[0])[1] if views else PoolTrack.Name.GREEN
            if not analysis_tick(plan, views, now, new_track=new, stable_tracks=stable):
                return "analysis"
        index = plan.current_step_index
        if index < len(plan.steps):
            if not claim_step(plan, index):
                return "skipped"
            (kind, arg), = plan.steps[index].items()
            lines = [step_label(plan, index)]
            outcome = apply_pause_or_analysis(plan, index, kind, arg, now, lines)
            record_action(plan, "rollout.step", lines, params={"step_index": index, "step": plan.steps[index]},
                          idempotency_key=f"rollout-{plan.pk}-step-{index}")
            return outcome
        plan.progress["mode"], plan.phase, plan.step_started_at = "switched", "switched", now
        lines = converge(plan, views)
        _publish(plan, lines)
        record_action(plan, "rollout.step", ["switch active to the preview", *lines], params={"phase": "switch"})
        schedule(plan, now, 0)
        return "switched"
    behind = switch_services(plan, views, to_new=True) or router_behind(plan)
    if behind is not None:
        check_deadline(plan, now, behind)
        plan.message = f"Waiting for {behind}."
        schedule(plan, now)
        return "waiting"
    if "switched_at" not in plan.progress:
        plan.progress["switched_at"] = now.isoformat()
        plan.message = f"Switched; the old track stays for {plan.scale_down_delay_s}s for an instant switch-back."
        schedule(plan, now, plan.scale_down_delay_s)
        return "scale-down-delay"
    plan.progress["mode"] = "done"
    lines = converge(plan, views)
    for view in views:
        track_delete(view, _names(plan, view)[0])
        type(view.pool).objects.filter(pk=view.pool.pk).update(model_version=plan.target_model_version)
    lines.append(f"old tracks removed; routing table v{publish()}")
    plan.state = transitions.next_state("complete", plan.state, name=plan.name)
    plan.phase, plan.next_step_at = "", None
    plan.message = f"Promoted: every pool runs {plan.target_model_version}."
    record_action(plan, "rollout.complete", [plan.message, *lines])
    return "promoted"


def cleanup(plan: RolloutPlan, now: datetime) -> str:
    """After an abort/failure: once the old track serves again and the router no longer sends traffic to
    the preview (its replicas went to 0, see :func:`converge`), remove the preview track."""
    views = pool_views(plan)
    _publish(plan, converge(plan, views))
    if any(v.tracks[_names(plan, v)[1]].replicas for v in views if _names(plan, v)[1] in v.tracks):
        schedule(plan, now)
        return "reverting"
    if plan.progress.get("switched_services") and switch_services(plan, views, to_new=False) is not None:
        schedule(plan, now)
        return "reverting"
    for view in views:
        old, _ = _names(plan, view)
        if min(view.ready.get(old, 0), view.tracks[old].replicas) < 1:
            schedule(plan, now)
            return "reverting"
    for view in views:
        track_delete(view, _names(plan, view)[1])
    version = publish()
    plan.progress["cleanup"] = False
    plan.next_step_at = None
    step_action_log(plan, f"reverted: preview tracks removed (routing table v{version})")
    return "reverted"


def start(plan: RolloutPlan, views: list[PoolView]) -> list[str]:
    """Create the preview tracks (called by ``rollout_start``); returns change lines."""
    from apps.rollouts.desired import track_ensure

    plan.progress["new_tracks"] = {}
    for view in views:
        old = plan.progress["stable_tracks"][view.key]
        new = preview_name(old)
        if new in view.tracks:
            raise RolloutFailure("fail", f"pool {view.pool} already has a {new} track; remove it first")
        track_ensure(view, new, plan.target_model_version, active=False, extra_args=plan.worker_args)
        plan.progress["new_tracks"][view.key] = new
    plan.progress["mode"], plan.phase = "preview", "preview"
    return converge(plan, views)
