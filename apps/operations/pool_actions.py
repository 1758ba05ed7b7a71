"""Handlers of the pool Action kinds: ``pool.scale``, ``pool.apply``, ``pool.restart_replica``, ``pool.delete``.

Every handler is idempotent — running it again (a Celery retry, or reconcile taking over an
expired lease) converges to the same final state and writes nothing the second time: desired
state is set to absolute values, and the backend verbs are idempotent (a scale to the current
count patches nothing). Scale and apply wait until the backend reports the desired replicas
ready (``FERRY_ACTION_READY_TIMEOUT_S``); the executor's heartbeat keeps the lease meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from django.conf import settings
from django.db import transaction

from apps.fleet.models import Cluster, Pool, PoolTrack
from apps.operations import services
from apps.operations.backends import backend_session, pool_ref, track_spec
from apps.operations.handlers import ActionError, register
from apps.operations.models import Action
from apps.orchestrators.base import NotFound, ObservedState, OrchestratorBackend, PoolRef

POOL_SCALE = "pool.scale"
POOL_APPLY = "pool.apply"
POOL_RESTART_REPLICA = "pool.restart_replica"
POOL_DELETE = "pool.delete"


def split_replicas(total: int, tracks: Sequence[PoolTrack]) -> dict[str, int]:
    """Split a pool's new ``total`` over its tracks in proportion to their current replicas.

    Falls back to the traffic weights when every track has 0 replicas, and to equal shares when
    those are 0 too. Largest remainder method (ties: track name order), so the parts sum to
    ``total`` exactly. The rollout controller re-splits during a rollout; outside one, the single
    ``stable`` track gets everything.

    Raises:
        ValueError: ``total`` < 0 or no tracks.
    """
    if total < 0 or not tracks:
        raise ValueError(f"cannot split {total} replicas over {len(tracks)} tracks")
    ordered = sorted(tracks, key=lambda t: t.name)
    shares = [t.replicas for t in ordered]
    if sum(shares) == 0:
        shares = [t.weight for t in ordered]
    if sum(shares) == 0:
        shares = [1] * len(ordered)
    exact = [total * s / sum(shares) for s in shares]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(ordered)), key=lambda i: (-(exact[i] - parts[i]), ordered[i].name))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return {t.name: n for t, n in zip(ordered, parts, strict=True)}


def _converged(observed: ObservedState, expected: Mapping[str, int]) -> bool:
    for track, replicas in expected.items():
        seen = observed.tracks.get(track)
        if seen is None:
            if replicas:
                return False
            continue
        alive = sum(1 for r in seen.replicas if r.alive)
        if seen.desired_replicas != replicas or seen.ready_replicas != replicas or (seen.replicas and alive != replicas):
            return False
    return True


def _describe(observed: ObservedState) -> str:
    return ", ".join(f"{name}: {t.ready_replicas}/{t.desired_replicas} ready"
                     for name, t in sorted(observed.tracks.items())) or "no tracks"


def wait_ready(backend: OrchestratorBackend, ref: PoolRef, expected: Mapping[str, int], *,
               timeout_s: float | None = None, poll_s: float = 0.5) -> ObservedState:
    """Poll ``observe`` until every track in ``expected`` has exactly that many ready replicas.

    Raises:
        ActionError: (retryable) not converged within ``timeout_s`` (default FERRY_ACTION_READY_TIMEOUT_S).
        BackendError: from ``observe``.
    """
    timeout_s = settings.FERRY_ACTION_READY_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        observed = backend.observe(ref)
        if _converged(observed, expected):
            return observed
        if time.monotonic() >= deadline:
            raise ActionError(f"not ready after {timeout_s:.0f}s: {_describe(observed)} "
                              f"(wanted {dict(expected)})", retryable=True)
        time.sleep(poll_s)


def _locked_pool(action: Action) -> Pool:
    if action.pool_id is None:
        raise ActionError(f"{action.kind} needs a pool, and action #{action.pk} has none (was it deleted?)")
    return Pool.objects.select_related("cluster").get(pk=action.pool_id)


def _tracks(pool: Pool) -> list[PoolTrack]:
    return list(pool.tracks.select_related("model_version").order_by("name"))


@register(POOL_SCALE)
def pool_scale_handler(action: Action) -> None:
    """Set the pool's total replicas (split over tracks), scale each track, wait until ready."""
    replicas = action.params.get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ActionError(f"params.replicas must be a non-negative integer, got {replicas!r}")
    pool = _locked_pool(action)
    with transaction.atomic():
        Pool.objects.select_for_update().filter(pk=pool.pk).first()
        tracks = _tracks(pool)
        if not tracks:
            raise ActionError(f"pool {pool} has no tracks to scale")
        split = split_replicas(replicas, tracks)
        changed = [t for t in tracks if t.replicas != split[t.name]]
        for track in changed:
            track.replicas = split[track.name]
            track.save(update_fields=["replicas"])
    desired = ", ".join(f"{name}={n}" for name, n in sorted(split.items()))
    services.action_log_append(action_id=action.pk, message=f"desired replicas {desired}"
                               + ("" if changed else " (already recorded)"))
    ref = pool_ref(pool)
    with backend_session(pool.cluster) as backend:
        for track in tracks:
            try:
                backend.scale_track(ref, track.name, track.replicas)
            except NotFound:  # never applied: create it with the full spec
                backend.apply_pool_track(track_spec(pool, track))
        observed = wait_ready(backend, ref, split)
    services.action_log_append(action_id=action.pk, message=f"ready: {_describe(observed)}")


@register(POOL_APPLY)
def pool_apply_handler(action: Action) -> None:
    """Apply every desired track with its full spec, delete tracks not desired, wait until ready."""
    pool = _locked_pool(action)
    tracks = _tracks(pool)
    ref = pool_ref(pool)
    with backend_session(pool.cluster) as backend:
        for track in tracks:
            backend.apply_pool_track(track_spec(pool, track))
        wanted = {t.name for t in tracks}
        for name in sorted(set(backend.observe(ref).tracks) - wanted):
            backend.delete_track(ref, name)
            services.action_log_append(action_id=action.pk, message=f"deleted track {name} (not desired)")
        observed = wait_ready(backend, ref, {t.name: t.replicas for t in tracks})
    services.action_log_append(action_id=action.pk, message=f"applied; ready: {_describe(observed)}")


@register(POOL_RESTART_REPLICA)
def pool_restart_replica_handler(action: Action) -> None:
    """Restart one replica by its backend name (``params.replica``)."""
    name = action.params.get("replica")
    if not isinstance(name, str) or not name:
        raise ActionError(f"params.replica must be a replica name, got {name!r}")
    pool = _locked_pool(action)
    with backend_session(pool.cluster) as backend:
        backend.restart_replica(pool_ref(pool), name)
    services.action_log_append(action_id=action.pk, message=f"restarted {name}")


@register(POOL_DELETE)
def pool_delete_handler(action: Action) -> None:
    """Remove a deleted pool's tracks from its backend (params carry what the deleted row held)."""
    params = action.params
    try:
        cluster = Cluster.objects.get(pk=params["cluster_id"])
        ref = PoolRef(pool_id=int(params["pool_id"]), pool_name=params["pool_name"],
                      namespace=params.get("namespace") or "default")
    except (KeyError, TypeError, ValueError, Cluster.DoesNotExist) as exc:
        raise ActionError(f"pool.delete params are incomplete or the cluster is gone: {exc!r}") from exc
    with backend_session(cluster) as backend:
        names = set(params.get("tracks", [])) | set(backend.observe(ref).tracks)
        for name in sorted(names):
            backend.delete_track(ref, name)
    services.action_log_append(action_id=action.pk, message=f"deleted tracks {sorted(names)}")
