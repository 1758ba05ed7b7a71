"""Writes for the fleet: clusters, links, pools (with their stable track) and pool scaling."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from apps.catalog.models import ModelVersion
from apps.core.errors import ConflictError
from apps.fleet.models import MAX_REPLICAS, Cluster, ClusterLink, Pool, PoolTrack
from apps.operations.models import Action
from apps.operations.services import action_create

POOL_SCALE = "pool.scale"


def _save(instance: Any, changes: dict[str, Any]) -> Any:
    for field, value in changes.items():
        setattr(instance, field, value)
    instance.full_clean()
    with transaction.atomic():
        instance.save()
    return instance


def cluster_create(**fields: Any) -> Cluster:
    """Create a cluster. Raises ValidationError (per-kind rules in ``Cluster.clean``)."""
    return _save(Cluster(), fields)


def cluster_update(*, cluster: Cluster, **changes: Any) -> Cluster:
    """Change a cluster's fields. Raises ValidationError."""
    return _save(cluster, changes)


def cluster_delete(*, cluster: Cluster) -> None:
    """Delete a cluster and its links. Raises ProtectedError (409) while it has pools."""
    with transaction.atomic():
        cluster.delete()


def cluster_link_create(**fields: Any) -> ClusterLink:
    """Create a link. Raises ValidationError (same cluster twice, bandwidth <= 0, rtt < 0, duplicate pair)."""
    return _save(ClusterLink(), fields)


def cluster_link_update(*, link: ClusterLink, **changes: Any) -> ClusterLink:
    """Change a link. Raises ValidationError."""
    return _save(link, changes)


def cluster_link_delete(*, link: ClusterLink) -> None:
    """Delete a link."""
    with transaction.atomic():
        link.delete()


def _check_replicas(replicas: Any) -> None:
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= MAX_REPLICAS:
        raise ValidationError({"replicas": [f"replicas must be an integer in 0..{MAX_REPLICAS}."]})


def pool_create(*, replicas: int, model_version: ModelVersion, **fields: Any) -> Pool:
    """Create a pool with one ``stable`` track of ``replicas`` running ``model_version``.

    Raises:
        ValidationError: invalid fields or replicas outside 0..10000.
    """
    _check_replicas(replicas)
    pool = Pool(model_version=model_version, **fields)
    pool.full_clean()
    with transaction.atomic():
        pool.save()
        PoolTrack.objects.create(pool=pool, name=PoolTrack.Name.STABLE, model_version=model_version,
                                 replicas=replicas, weight=100, active=True)
    return pool


def _in_active_rollout(pool: Pool) -> bool:
    from apps.rollouts.selectors import rollout_active_for_pool

    return rollout_active_for_pool(pool=pool) is not None


def pool_update(*, pool: Pool, **changes: Any) -> Pool:
    """Change a pool's settings; a new ``model_version`` also moves its stable track.

    Raises:
        ValidationError: invalid fields.
        ConflictError: changing the model version or cluster while a rollout involves the pool.
    """
    moving = {f for f in ("model_version", "cluster") if f in changes and changes[f] != getattr(pool, f)}
    if moving and _in_active_rollout(pool):
        raise ConflictError(f"Pool {pool} is part of an active rollout; finish or abort it before changing "
                            f"{', '.join(sorted(moving))}.")
    with transaction.atomic():
        _save(pool, changes)
        if "model_version" in moving:
            pool.tracks.filter(name=PoolTrack.Name.STABLE).update(model_version=pool.model_version)
    return pool


def pool_delete(*, pool: Pool) -> None:
    """Delete a pool and its tracks.

    Raises:
        ConflictError: an Action is pending/running for it, or a rollout involving it is active.
    """
    with transaction.atomic():
        busy = Action.objects.filter(pool=pool, status__in=Action.ACTIVE_STATUSES).first()
        if busy is not None:
            raise ConflictError(f"Pool {pool} has action #{busy.pk} ({busy.status}); wait or cancel it first.")
        if _in_active_rollout(pool):
            raise ConflictError(f"Pool {pool} is part of an active rollout; finish or abort it first.")
        pool.delete()


def pool_scale(
    *, pool: Pool, replicas: int, requested_by: AbstractBaseUser | None = None, idempotency_key: str | None = None
) -> tuple[Action, bool]:
    """Request a new total replica count: creates a pending ``pool.scale`` Action (executed by a task).

    The desired state changes when the Action runs (its handler writes the tracks and calls the backend).

    Raises:
        ValidationError: replicas outside 0..10000, or outside min..max while autoscaling is on.
        ConflictError: the pool already has a pending or running Action, or the key was reused.
    """
    _check_replicas(replicas)
    if pool.autoscaling_enabled and not pool.min_replicas <= replicas <= pool.max_replicas:
        raise ValidationError({"replicas": [
            f"Autoscaling keeps this pool within {pool.min_replicas}..{pool.max_replicas} replicas; "
            "change min/max or disable autoscaling first."
        ]})
    return action_create(
        kind=POOL_SCALE, target_type="pool", target_id=str(pool.pk), target_repr=str(pool), pool=pool,
        params={"replicas": replicas}, requested_by=requested_by, idempotency_key=idempotency_key,
    )
