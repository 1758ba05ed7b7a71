"""Traffic moves shared by canary and blue-green: the scale-down hold, the router's acknowledgement of a routing
table, publishing after desired-state changes, and readiness counts.

Traffic leaves a track before its replicas do: a shrinking track keeps its replicas until the router reports
the routing table that no longer sends them traffic (:func:`scale_down_hold`).
"""

from __future__ import annotations

from django.utils import timezone

from apps.rollouts.desired import PoolView, publish, router_applied_version
from apps.rollouts.gateway import gateway_behind
from apps.rollouts.models import RolloutPlan


def replicas_text(count: int) -> str:
    """``1 replica``, ``2 replicas``."""
    return f"{count} replica" + ("" if count == 1 else "s")


def ready_count(view: PoolView, name: str) -> int:
    """Ready replicas of track ``name`` counted up to its desired replicas (0 for a missing track)."""
    track = view.tracks.get(name)
    return min(view.ready.get(name, 0), track.replicas) if track is not None else 0


def router_behind(plan: RolloutPlan) -> str | None:
    """None once the router (if any) reports the awaited routing-table version and every Gateway API route of
    the plan carries its weights and is Accepted (:func:`apps.rollouts.gateway.gateway_behind`), else what is
    awaited."""
    awaited = plan.typed_progress.await_version
    if plan.router_id is None or awaited is None:
        return gateway_behind(plan)
    seen = router_applied_version(plan.router.url)
    if seen is not None and seen >= awaited:
        return gateway_behind(plan)
    return f"the router at {plan.router.url} to apply routing table v{awaited} (it reports {seen})"


def scale_down_hold(plan: RolloutPlan, *, weights_changed: bool) -> str | None:
    """Why replicas whose traffic was just moved away must stay for now (None: they may go).

    With a registered router (``router``) a track's replicas are removed only once the router reports the
    routing table that no longer sends them traffic: not in the tick that changes the weights, nor while
    the router is behind. Otherwise a request routed by the old table reaches a draining replica, and a
    retry cannot help when no other replica serves that track's version. The hold ends after
    ``progress_deadline_s`` from the start of the step (a router that never answers does not keep the
    replicas forever). Without a router nothing is held.
    """
    if plan.router_id is None:
        return None
    started = plan.step_started_at
    if started is not None and (timezone.now() - started).total_seconds() > plan.progress_deadline_s:
        return None
    if weights_changed:
        return "the router to apply the new weights before replicas are removed"
    return router_behind(plan)


def publish_if_changed(plan: RolloutPlan, lines: list[str]) -> None:
    """After desired-state changes (``lines`` not empty): publish the routing table and wait for its version."""
    if lines:
        plan.typed_progress.await_version = publish()
        lines.append(f"routing table v{plan.typed_progress.await_version}")
