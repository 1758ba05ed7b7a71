"""Verbs on pools and replicas that reach a backend: scale and delete a pool (each records an Action,
executed by :mod:`apps.operations.pool_actions`), and read a replica's logs.

Requests from the API (and the dashboard through it), the admin and the autoscaler come here; fleet keeps the state
(:mod:`apps.fleet.services`: create/update a pool, observed replicas, the routing table).
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from apps.core.errors import ConflictError
from apps.fleet.holds import pool_hold_reason
from apps.fleet.models import Pool, Replica, validate_replica_count
from apps.operations.backends import backend_session, pool_ref
from apps.operations.models import Action
from apps.operations.pool_actions import POOL_DELETE, POOL_SCALE
from apps.operations.services import action_create


def pool_delete(*, pool: Pool) -> Action | None:
    """Delete a pool and its tracks, and request a ``pool.delete`` Action that stops its workers.

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
                                  params=params)
    return action


def pool_scale(
    *, pool: Pool, replicas: int, requested_by: AbstractBaseUser | None = None, idempotency_key: str | None = None
) -> tuple[Action, bool]:
    """Request a new total replica count: creates a pending ``pool.scale`` Action (executed by a task).

    The desired state changes when the Action runs (its handler writes the tracks and calls the backend).

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


def pool_scale_by_system(*, pool: Pool, replicas: int, reason: str, idempotency_key: str) -> tuple[Action, bool]:
    """A ``pool.scale`` Action requested by the autoscaler or a schedule window, with its reason.

    Unlike :func:`pool_scale` it does not check min/max (the autoscaler clamps, and a schedule
    window may set any total); the reason is stored in ``params.reason``.

    Raises:
        ValidationError: replicas outside 0..10000. ConflictError: the pool is busy.
    """
    validate_replica_count(replicas)
    return action_create(
        kind=POOL_SCALE, target_type="pool", target_id=str(pool.pk), target_repr=str(pool), pool=pool,
        params={"replicas": replicas, "reason": reason}, idempotency_key=idempotency_key,
    )


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
