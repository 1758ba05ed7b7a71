"""What a rollout plan will do, step by step, before it starts: replicas per track per pool and the canary
weight after each step (the create form's preview, ``POST /api/v1/rollouts/preview/``).

The numbers come from the controller's own functions, not a copy: the pool total ``R`` and the stable
track as :func:`apps.rollouts.desired.pool_views` / :func:`~apps.rollouts.desired.active_track_name` see
them at start, and the split of each ``set_weight`` step from :func:`apps.rollouts.replica_math.canary_split`
(the R=1 rule included: a weight that needs a surge replica shows it, and one that cannot be served with
``max_surge`` carries the controller's error, the one ``rollout_start`` would refuse with). These are the
targets of each step once converged; while moving, the controller never exceeds ``R + max_surge`` replicas.
"""

from __future__ import annotations

from typing import Any

from apps.fleet.models import Pool, PoolTrack
from apps.rollouts.bluegreen import preview_name
from apps.rollouts.canary import NEW_TRACK
from apps.rollouts.desired import PoolView, active_track_name
from apps.rollouts.models import RolloutPlan
from apps.rollouts.replica_math import ReplicaMathError, canary_split
from apps.rollouts.steps import step_text


def _views(pools: list[Pool]) -> list[PoolView]:
    """The pools as the controller sees them at start (tracks by name, total = the sum of desired replicas)."""
    pools = sorted(pools, key=lambda p: p.pk)
    by_pool: dict[int, dict[str, PoolTrack]] = {p.pk: {} for p in pools}
    for track in PoolTrack.objects.filter(pool__in=pools):
        by_pool[track.pool_id][track.name] = track
    return [PoolView(p, by_pool[p.pk], total=sum(t.replicas for t in by_pool[p.pk].values())) for p in pools]


def _canary_row(view: PoolView, stable: str, weight: int, max_surge: int) -> tuple[dict[str, int], str | None]:
    try:
        canary, kept = canary_split(view.total, weight, max_surge=max_surge)
    except ReplicaMathError as exc:
        return {stable: view.total, NEW_TRACK: 0}, f"pool {view.pool.name}: {exc}"
    return {stable: kept, NEW_TRACK: canary}, None


def rollout_preview(*, pools: list[Pool], strategy: str, steps: list[dict], max_surge: int,
                    scale_down_delay_s: int = 30, **_ignored: Any) -> dict[str, Any]:
    """The plan's effect per step, from the controller's replica math (module docstring).

    Args:
        pools: the plan's pools (validated: one stable version, prefill with decode).
        strategy: ``canary`` or ``blue_green``; steps: validated steps (:mod:`apps.rollouts.validators`).
        max_surge: extra replicas allowed above a pool's total; scale_down_delay_s: blue-green only.

    Returns:
        ``{"strategy", "pools": [{"id", "name", "role", "total", "stable_track", "new_track"}],
        "rows": [{"number" (1-based step number, None for the start and the end), "text", "weight" (canary or
        new-track traffic percent after the row), "replicas": {pool id (str): {track: replicas}}, "error"}],
        "errors": [the rows' errors]}``. Rows: the start, one per step, then the end (weight 100 and
        finalize for a canary; the switch for blue-green). Two queries.

    Raises:
        ValueError: a pool has no stable, blue or green track (``active_track_name``).
    """
    views = _views(pools)
    stable = {v.key: active_track_name(v) for v in views}
    new = {v.key: (NEW_TRACK if strategy == RolloutPlan.Strategy.CANARY else preview_name(stable[v.key]))
           for v in views}
    out_pools = [{"id": v.pool.pk, "name": v.pool.name, "role": v.pool.role, "total": v.total,
                  "stable_track": stable[v.key], "new_track": new[v.key]} for v in views]
    rows: list[dict[str, Any]] = []

    def row(number: int | None, text: str, weight: int, replicas: dict[str, dict[str, int]],
            error: str | None = None) -> None:
        rows.append({"number": number, "text": text, "weight": weight, "replicas": replicas, "error": error})

    if strategy == RolloutPlan.Strategy.CANARY:
        weight = 0
        row(None, "start: canary track created", 0, {v.key: {stable[v.key]: v.total, NEW_TRACK: 0} for v in views})
        for number, step in enumerate(steps, start=1):
            if "set_weight" in step:
                weight = step["set_weight"]
            replicas, errors = {}, []
            for v in views:
                replicas[v.key], error = _canary_row(v, stable[v.key], weight, max_surge)
                if error and "set_weight" in step:
                    errors.append(error)
            row(number, step_text(step), weight, replicas, "; ".join(errors) or None)
        if weight != 100:
            row(None, "all steps done: canary weight to 100%", 100,
                {v.key: _canary_row(v, stable[v.key], 100, max_surge)[0] for v in views})
        row(None, "finalize: the stable tracks take the new version, the canary track is removed", 100,
            {v.key: {stable[v.key]: v.total} for v in views})
    else:
        preview = {v.key: {stable[v.key]: v.total, new[v.key]: v.total} for v in views}
        row(None, "start: preview tracks at the pool total, no traffic (then smoke check)", 0, preview)
        for number, step in enumerate(steps, start=1):
            row(number, step_text(step), 0, preview)
        row(None, "switch: all traffic to the new version", 100, preview)
        row(None, f"{scale_down_delay_s} s later: the old track scales to 0", 100,
            {v.key: {stable[v.key]: 0, new[v.key]: v.total} for v in views})
    return {"strategy": strategy, "pools": out_pools, "rows": rows,
            "errors": [r["error"] for r in rows if r["error"]]}
