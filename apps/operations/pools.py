"""Verbs on pools and replicas that reach a backend: scale, update and delete a pool (each records Actions,
executed by :mod:`apps.operations.pool_actions` and :mod:`apps.operations.tracks`), and read a replica's logs.

Requests from the API (and the dashboard through it), the admin and the autoscaler come here; fleet keeps the state
(:mod:`apps.fleet.services`: create a pool, its settings, observed replicas, the routing table). Pool tracks change
only through :mod:`apps.operations.tracks`.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from apps.core.errors import ConflictError
from apps.fleet import services as fleet_services
from apps.fleet.holds import pool_hold_reason
from apps.fleet.models import Pool, PoolTrack, Replica, new_worker_token, validate_replica_count
from apps.operations import tracks
from apps.operations.backends import backend_session, pool_ref
from apps.operations.models import Action
from apps.operations.pool_actions import POOL_APPLY, POOL_DELETE, POOL_FLUSH_KV_CACHE, POOL_SCALE
from apps.operations.services import action_create

AUTOSCALER = "autoscaler"
"""The requester of the autoscaler's (and schedule windows') ``pool.scale`` Actions and their track Actions."""


def pool_delete(*, pool: Pool, requested_by: AbstractBaseUser | None = None) -> Action | None:
    """Delete a pool and its tracks, and request a ``pool.delete`` Action, recorded as ``requested_by``'s, that stops
    its workers. Plans made for the pool go with it (a plan is for two pools).

    The Action carries what the backend needs (cluster, pool id and name, namespace, tracks) because
    the row is gone when it runs. Returns that Action (None when the pool never had replicas).

    Raises:
        ConflictError: an Action is pending/running for it, or a hold is on it (an active rollout involves it;
            :mod:`apps.fleet.holds`).
    """
    with transaction.atomic():
        busy = Action.objects.filter(pool=pool, status__in=Action.ACTIVE_STATUSES).first()
        if busy is not None:
            raise ConflictError(f"Pool {pool} has action #{busy.pk} ({busy.status}); wait or cancel it first.")
        held_by = pool_hold_reason(pool)
        if held_by is not None:
            raise ConflictError(f"Pool {pool} is part of {held_by}; finish or abort it first.")
        tracks = sorted(pool.tracks.values_list("name", flat=True))
        ever_ran = pool.actions.exists() or pool.observed_replicas.exists()
        params = {"cluster_id": pool.cluster_id, "pool_id": pool.pk, "pool_name": pool.name,
                  "namespace": pool.cluster.namespace or "default", "tracks": tracks}
        target = (str(pool.pk), str(pool))
        pool.delete()
        if not ever_ran:
            return None
        action, _ = action_create(kind=POOL_DELETE, target_type="pool", target_id=target[0], target_repr=target[1],
                                  params=params, requested_by=requested_by)
    return action


def pool_scale(
    *, pool: Pool, replicas: int, requested_by: AbstractBaseUser | None = None, idempotency_key: str | None = None
) -> tuple[Action, bool]:
    """Request a new total replica count: creates a pending ``pool.scale`` Action (executed by a task).

    The desired state changes when the Action runs: its handler splits the total over the tracks through
    :func:`apps.operations.tracks.pool_total_set` (one ``pool.track_set`` Action per changed track, requested by
    the user's name) and runs those Actions, whose handlers call the backend.

    Raises:
        ValidationError: replicas outside 0..10000, or outside min..max while autoscaling is on.
        ConflictError: the pool already has a pending or running Action, or the key was reused.
    """
    validate_replica_count(replicas)
    if pool.autoscaling_enabled and not pool.min_replicas <= replicas <= pool.max_replicas:
        raise ValidationError({"replicas": [
            f"Autoscaling keeps this pool within {pool.min_replicas}..{pool.max_replicas} replicas; "
            "change min/max or disable autoscaling first."
        ]})
    return action_create(
        kind=POOL_SCALE, target_type="pool", target_id=str(pool.pk), target_repr=str(pool), pool=pool,
        params={"replicas": replicas}, requested_by=requested_by, idempotency_key=idempotency_key,
    )


def pool_flush_kv_cache(
    *, pool: Pool, requested_by: AbstractBaseUser | None = None, idempotency_key: str | None = None
) -> tuple[Action, bool]:
    """Request a prefix-cache flush of every running replica: creates a pending ``pool.flush_kv_cache`` Action
    (executed by a task: :func:`apps.operations.pool_actions.pool_flush_kv_cache_handler`).

    Raises:
        ConflictError: the pool already has a pending or running Action, or the key was reused.
    """
    return action_create(
        kind=POOL_FLUSH_KV_CACHE, target_type="pool", target_id=str(pool.pk), target_repr=str(pool), pool=pool,
        params={}, requested_by=requested_by, idempotency_key=idempotency_key,
    )


def pool_worker_token_rotate(
    *, pool: Pool, keep_previous: bool = True, requested_by: AbstractBaseUser | None = None,
    idempotency_key: str | None = None,
) -> tuple[Action, bool]:
    """Give the pool a new worker token and roll it out: one transaction sets ``worker_token`` to a fresh token
    (``worker_token_previous`` to the old one, or "" without ``keep_previous``) and creates a pending ``pool.apply``
    Action, whose handler re-applies every track with the new tokens (the local agent replaces each replica whose
    environment changed; Kubernetes updates the pool's Secret and rolls the Deployments, whose pod template
    carries the tokens' digest). The routing table is published after commit, so routers send the new token.

    During the roll nothing fails: new replicas accept the new and the previous token; routers and the KV cache
    flush send the new one and, on a replica's 401 (not rolled yet), the previous one once. The previous token
    stays accepted until the next rotation; rotate with ``keep_previous=False`` when the old token leaked (replicas
    not yet rolled then refuse the routers' calls until they restart, a short 502 window per replica).

    A second call with the same ``idempotency_key`` returns the first Action and rotates nothing.

    Raises:
        ConflictError: the pool already has a pending or running Action (nothing is rotated), or the key was reused
            for another request.
    """
    params = {"reason": "worker token rotated", "keep_previous": bool(keep_previous)}
    with transaction.atomic():
        locked = Pool.objects.select_for_update().get(pk=pool.pk)
        action, created = action_create(
            kind=POOL_APPLY, target_type="pool", target_id=str(pool.pk), target_repr=str(pool), pool=locked,
            params=params, requested_by=requested_by, idempotency_key=idempotency_key,
        )
        if created:
            locked.worker_token_previous = locked.worker_token if keep_previous else ""
            locked.worker_token = new_worker_token()
            locked.save(update_fields=["worker_token", "worker_token_previous", "updated_at"])
        transaction.on_commit(fleet_services.routing_table_publish)
    return action, created


def pool_scale_by_system(*, pool: Pool, replicas: int, reason: str, idempotency_key: str) -> tuple[Action, bool]:
    """A ``pool.scale`` Action requested by the autoscaler or a schedule window, with its reason.

    Unlike :func:`pool_scale` it does not check min/max (the autoscaler clamps, and a schedule
    window may set any total); the reason is stored in ``params.reason``. Its log and its track Actions
    say ``requested by autoscaler``.

    Raises:
        ValidationError: replicas outside 0..10000. ConflictError: the pool is busy.
    """
    validate_replica_count(replicas)
    return action_create(
        kind=POOL_SCALE, target_type="pool", target_id=str(pool.pk), target_repr=str(pool), pool=pool,
        params={"replicas": replicas, "reason": reason}, idempotency_key=idempotency_key, requester=AUTOSCALER,
    )


def pool_update(*, pool: Pool, requested_by: AbstractBaseUser | None = None, **changes: Any) -> Pool:
    """Change a pool's settings (:func:`apps.fleet.services.pool_update`); a new ``model_version`` also moves the
    stable track, through :func:`apps.operations.tracks.pool_track_set`: one ``pool.track_set`` Action, requested
    by ``requested_by``'s name, whose handler applies the track's new spec after commit. One transaction.

    Raises:
        ValidationError: invalid fields.
        ConflictError: changing the model version or cluster while a hold is on the pool (an active rollout
            involves it; :mod:`apps.fleet.holds`).
    """
    before = pool.model_version_id
    with transaction.atomic():
        pool = fleet_services.pool_update(pool=pool, **changes)
        stable = pool.tracks.select_related("pool").filter(name=PoolTrack.Name.STABLE).first()
        if pool.model_version_id != before and stable is not None:
            latest = (Action.objects.filter(target_type="pool", target_id=str(pool.pk)).order_by("-id")
                      .values_list("id", flat=True).first() or 0)
            tracks.pool_track_set(track=stable, model_version=pool.model_version, requested_by=requested_by,
                                  requester=requested_by.get_username() if requested_by is not None else "system",
                                  idempotency_key=f"pool-{pool.pk}:model-version-{pool.model_version_id}"
                                                  f":after-{latest}")
    return pool


def replica_logs(*, replica: Replica, tail: int) -> list[str]:
    """The last ``tail`` lines of ``replica``'s stdout/stderr, read from its cluster's backend.

    Raises:
        apps.orchestrators.base.NotFound: the backend no longer has that replica.
        apps.orchestrators.base.BackendUnavailable: the backend cannot be reached.
        apps.orchestrators.base.InvalidSpec: the cluster's backend is not configured (e.g. no agent token).
    """
    with backend_session(replica.pool.cluster) as backend:
        text = backend.logs(pool_ref(replica.pool), replica.name, tail)
    return text.splitlines()[-tail:]
