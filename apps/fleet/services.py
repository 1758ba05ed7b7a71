"""Writes for the fleet: clusters, links, pools (with their stable track), pool scaling, observed
replicas and the published routing table."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from apps.catalog.models import ModelVersion
from apps.core.errors import ConflictError
from apps.fleet import selectors
from apps.fleet.models import MAX_REPLICAS, Cluster, ClusterLink, Pool, PoolTrack, Replica, RoutingTable
from apps.fleet.routing_table import content_digest, routing_table_content
from apps.operations.models import Action
from apps.operations.services import action_create

POOL_SCALE = "pool.scale"
POOL_DELETE = "pool.delete"


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


def pool_delete(*, pool: Pool) -> Action | None:
    """Delete a pool and its tracks, and request a ``pool.delete`` Action that stops its workers.

    The Action carries what the backend needs (cluster, pool id and name, namespace, tracks) because
    the row is gone when it runs. Returns that Action (None when the pool never had replicas).

    Raises:
        ConflictError: an Action is pending/running for it, or a rollout involving it is active.
    """
    with transaction.atomic():
        busy = Action.objects.filter(pool=pool, status__in=Action.ACTIVE_STATUSES).first()
        if busy is not None:
            raise ConflictError(f"Pool {pool} has action #{busy.pk} ({busy.status}); wait or cancel it first.")
        if _in_active_rollout(pool):
            raise ConflictError(f"Pool {pool} is part of an active rollout; finish or abort it first.")
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


def pool_scale_by_system(*, pool: Pool, replicas: int, reason: str, idempotency_key: str) -> tuple[Action, bool]:
    """A ``pool.scale`` Action requested by the autoscaler or a schedule window, with its reason.

    Unlike :func:`pool_scale` it does not check min/max (the autoscaler clamps, and a schedule
    window may set any total); the reason is stored in ``params.reason``.

    Raises:
        ValidationError: replicas outside 0..10000. ConflictError: the pool is busy.
    """
    _check_replicas(replicas)
    return action_create(
        kind=POOL_SCALE, target_type="pool", target_id=str(pool.pk), target_repr=str(pool), pool=pool,
        params={"replicas": replicas, "reason": reason}, idempotency_key=idempotency_key,
    )


def replicas_refresh(*, pool: Pool, observed: Any) -> tuple[int, int]:
    """Make the pool's ``Replica`` rows match an ``ObservedState``; returns (upserted, deleted).

    ``last_seen`` is now for every observed replica; rows no longer observed are deleted.
    """
    now = timezone.now()
    seen = []
    with transaction.atomic():
        for track in observed.tracks.values():
            for r in track.replicas:
                Replica.objects.update_or_create(pool=pool, name=r.name, defaults={
                    "track": r.track or track.track, "endpoint": r.endpoint, "ready": r.ready and r.alive,
                    "alive": r.alive, "version": r.version, "restart_count": r.restart_count,
                    "exit_code": r.exit_code, "last_seen": now,
                })
                seen.append(r.name)
        deleted, _ = Replica.objects.filter(pool=pool).exclude(name__in=seen).delete()
    return len(seen), deleted


def routing_table_publish() -> tuple[RoutingTable, bool]:
    """Rebuild the routing table; bump its version only if the content changed. Returns (table, changed).

    Concurrent publishers serialize on the row (``select_for_update``), so one change is one version.
    """
    content = routing_table_content(list(selectors.routing_pools()), selectors.cluster_link_list(),
                                    threshold_tokens=settings.FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS)
    digest = content_digest(content)
    with transaction.atomic():
        table, created = RoutingTable.objects.select_for_update().get_or_create(
            pk=1, defaults={"version": 1, "digest": digest, "content": content})
        if created:
            return table, True
        if table.digest == digest:
            return table, False
        table.version += 1
        table.digest, table.content = digest, content
        table.save()
    return table, True
