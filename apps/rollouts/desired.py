"""Desired-state reads and writes of the rollout controller: pool views, track writes, Action records.

The rollout controller owns the split between tracks and the traffic weights while a rollout is in
progress (DESIGN.md, "Desired state"); it changes ``PoolTrack`` rows only through the services of
:mod:`apps.operations.tracks` — one ``pool.*`` Action per change, requested by ``rollout:<id>``, whose
execution (after the rollout's transaction commits) makes the backend call — and publishes the routing
table. Readiness comes back as observed ``Replica`` rows (reconcile). Every controller transition is also
recorded as an ``Action`` (``rollout.<verb>``, target ``rollout``, no pool lock) written as already
succeeded: it records the decision, made in the same transaction as the state change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from django.db.models import Count, Q
from django.utils import timezone

from apps.catalog.models import ModelVersion
from apps.fleet.models import Pool, PoolTrack, Replica
from apps.fleet.services import routing_table_publish
from apps.operations import tracks
from apps.operations.models import Action
from apps.operations.services import action_log_append
from apps.rollouts.models import RolloutPlan

ACTIVE_NAMES = (PoolTrack.Name.STABLE, PoolTrack.Name.BLUE, PoolTrack.Name.GREEN)
SERVING_ROLES = (Pool.Role.DECODE, Pool.Role.COLOCATED)


@dataclass
class PoolView:
    """One pool of a rollout: its tracks (by name), ready replicas per track, and its total ``R``."""

    pool: Pool
    tracks: dict[str, PoolTrack]
    ready: dict[str, int] = field(default_factory=dict)
    alive: dict[str, int] = field(default_factory=dict)
    """Observed replicas per track that are still running, whatever their version or readiness."""
    total: int = 0

    @property
    def key(self) -> str:
        return str(self.pool.pk)

    @property
    def serving(self) -> bool:
        return self.pool.role in SERVING_ROLES


def pool_views(plan: RolloutPlan) -> list[PoolView]:
    """The plan's pools with tracks and ready replica counts (3 queries), ordered by pool id.

    A replica counts as ready for a track when it is ready, alive, and runs the track's model
    version (or reports none); ``alive`` counts every running replica of a track. ``total`` is the pool total recorded at start (``progress.totals``),
    else the current sum of desired replicas.
    """
    pools = list(plan.pools.select_related("cluster").order_by("id"))
    tracks = PoolTrack.objects.filter(pool__in=pools).select_related("model_version")
    by_pool: dict[int, dict[str, PoolTrack]] = {p.pk: {} for p in pools}
    for track in tracks:
        by_pool[track.pool_id][track.name] = track
    counts = list(Replica.objects.filter(pool__in=pools, alive=True)
                  .values("pool_id", "track", "version", "ready").annotate(n=Count("id")))
    totals = plan.typed_progress.totals
    views = []
    for pool in pools:
        view = PoolView(pool, by_pool[pool.pk])
        for row in counts:
            if row["pool_id"] != pool.pk:
                continue
            view.alive[row["track"]] = view.alive.get(row["track"], 0) + row["n"]
            track = view.tracks.get(row["track"])
            if row["ready"] and track is not None and row["version"] in ("", track.model_version.version):
                view.ready[row["track"]] = view.ready.get(row["track"], 0) + row["n"]
        view.total = int(totals.get(view.key, sum(t.replicas for t in view.tracks.values())))
        views.append(view)
    return views


def active_track_name(view: PoolView) -> str:
    """The track serving the stable version: the active stable/blue/green track with the highest weight."""
    candidates = [t for n, t in view.tracks.items() if n in ACTIVE_NAMES and t.active]
    if not candidates:
        candidates = [t for n, t in view.tracks.items() if n in ACTIVE_NAMES]
    if not candidates:
        raise ValueError(f"pool {view.pool} has no stable, blue or green track")
    return max(candidates, key=lambda t: (t.weight, t.replicas, t.name)).name


def requester(plan: RolloutPlan) -> str:
    """Who the rollout's pool-track Actions say asked for them: ``rollout:<id>``."""
    return f"rollout:{plan.pk}"


def _change_key(plan: RolloutPlan) -> str:
    """The idempotency key of the plan's next pool-track Action (``rollout-<id>:change-<n>``)."""
    return f"rollout-{plan.pk}:change-{plan.typed_progress.num_track_changes + 1}"


def _counted(plan: RolloutPlan, action: Action | None) -> Action | None:
    if action is not None:
        plan.typed_progress.num_track_changes += 1
    return action


def track_ensure(plan: RolloutPlan, view: PoolView, name: str, version: ModelVersion, *, active: bool,
                 extra_args: str = "") -> PoolTrack:
    """Create track ``name`` at 0 replicas and weight 0 with the worker options ``extra_args`` if missing
    (one ``pool.track_set`` Action), else return it unchanged."""
    track = view.tracks.get(name)
    if track is None:
        track, action = tracks.pool_track_create(pool=view.pool, name=name, model_version=version, active=active,
                                                 extra_args=extra_args, requester=requester(plan),
                                                 idempotency_key=_change_key(plan))
        _counted(plan, action)
        view.tracks[name] = track
    return track


def track_write(plan: RolloutPlan, track: PoolTrack, **values: object) -> bool:
    """Set fields of a track through :func:`apps.operations.tracks.pool_track_set` (one Action when something
    changed). Returns whether anything changed."""
    action = tracks.pool_track_set(track=track, requester=requester(plan), idempotency_key=_change_key(plan),
                                   **values)
    return _counted(plan, action) is not None


def track_delete(plan: RolloutPlan, view: PoolView, name: str) -> bool:
    """Remove a track: its row now, its backend objects by the ``pool.track_delete`` Action after commit.
    Returns whether it existed."""
    track = view.tracks.pop(name, None)
    if track is None:
        return False
    _counted(plan, tracks.pool_track_delete(track=track, requester=requester(plan),
                                            idempotency_key=_change_key(plan)))
    return True


def switch_request(plan: RolloutPlan, view: PoolView, name: str) -> Action:
    """Request the backend's ``switch_active`` of ``view``'s pool to track ``name`` (a ``pool.switch_active``
    Action, run right after the caller's transaction by :func:`run_switches`)."""
    action = tracks.pool_active_switch(pool=view.pool, track=name, requester=requester(plan),
                                       idempotency_key=_change_key(plan))
    _counted(plan, action)
    return action


def run_switches(plan_id: int) -> dict[int, str]:
    """Run the plan's pending ``pool.switch_active`` Actions now (call after the plan's transaction committed:
    no row lock is held). The Celery task sent on commit does nothing for an Action that already ran."""
    pending = Action.objects.filter(kind=tracks.POOL_SWITCH_ACTIVE, status=Action.Status.PENDING,
                                    target_type="pool", params__requester=f"rollout:{plan_id}").order_by("id")
    return tracks.actions_execute(action_ids=list(pending.values_list("pk", flat=True)))


def publish() -> int:
    """Publish the routing table; returns its version (unchanged content keeps the version)."""
    table, _ = routing_table_publish()
    return table.version


def record_action(plan: RolloutPlan, kind: str, lines: list[str], *, params: dict | None = None,
                  requested_by=None, idempotency_key: str | None = None,  # noqa: ANN001 - a user
                  succeeded: bool = True, error: str = "") -> Action:
    """Write one finished ``rollout.<verb>`` Action for ``plan`` with its log lines (``error``: why it failed).

    Its first log line names who asked: the user, else ``rollout:<id>`` (the Actions API's ``requester``)."""
    now = timezone.now()
    log = [{"at": now.isoformat(), "message": f"requested by {requested_by or requester(plan)}"},
           *({"at": now.isoformat(), "message": line} for line in lines)]
    return Action.objects.create(
        kind=kind, target_type="rollout", target_id=str(plan.pk), target_repr=plan.name[:200],
        params=params or {}, requested_by=requested_by, idempotency_key=idempotency_key,
        status=Action.Status.SUCCEEDED if succeeded else Action.Status.FAILED, attempts=1,
        started_at=now, finished_at=now, log=log, error="" if succeeded else error,
        retryable=None if succeeded else False,
    )


def last_action(plan: RolloutPlan) -> Action | None:
    """The newest Action of ``plan``."""
    return (Action.objects.filter(target_type="rollout", target_id=str(plan.pk)).order_by("-id").first())


def step_action_log(plan: RolloutPlan, message: str) -> None:
    """Append a line to the plan's newest Action (intra-step progress: scale moves, weights, acks)."""
    action = last_action(plan)
    if action is not None:
        action_log_append(action_id=action.pk, message=message)


def router_applied_version(url: str, *, timeout_s: float = 2.0) -> int | None:
    """The routing table version the router at ``url`` applied (its ``/ready``), or None if unknown."""
    try:
        response = httpx.get(url.rstrip("/") + "/ready", timeout=timeout_s)
        version = response.json().get("routing_table_version")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return version if isinstance(version, int) else None


def ready_endpoints(view: PoolView, track: str) -> list[str]:
    """Endpoints of the ready, alive replicas of ``track`` (for the blue-green smoke test)."""
    version = view.tracks[track].model_version.version
    return list(Replica.objects.filter(pool=view.pool, track=track, ready=True, alive=True)
                .filter(Q(version="") | Q(version=version)).exclude(endpoint="")
                .order_by("name").values_list("endpoint", flat=True))
