"""Writes for the fleet's state: clusters, links, pools (a new pool with its first stable track), observed
replicas and the published routing table. Every later change of a pool's tracks, and the verbs that reach a
backend (pool scale, update of the model version, delete, replica logs), are operations'
(:mod:`apps.operations.tracks`, :mod:`apps.operations.pools`)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.selectors import client_keys_routed
from apps.catalog.models import ModelVersion
from apps.core.errors import ConflictError
from apps.fleet import selectors
from apps.fleet.holds import pool_hold_reason
from apps.fleet.models import (
    Cluster,
    ClusterLink,
    Pool,
    PoolTrack,
    Replica,
    Router,
    RoutingTable,
    validate_replica_count,
)
from apps.fleet.routing_table import content_digest, routing_table_content
from apps.fleet.routing_table_cache import routing_table_cache_store


def _save(instance: Any, changes: dict[str, Any], *, publish: bool = False) -> Any:
    """Validate and save; with ``publish`` the routing table is republished in the same transaction (for rows
    the table is built from: a router then sees the change within its poll interval, not at the next reconcile
    tick)."""
    for field, value in changes.items():
        setattr(instance, field, value)
    instance.full_clean()
    with transaction.atomic():
        instance.save()
        if publish:
            routing_table_publish()
    return instance


def cluster_create(**fields: Any) -> Cluster:
    """Create a cluster. Raises ValidationError (per-kind rules in ``Cluster.clean``)."""
    return _save(Cluster(), fields)


def cluster_update(*, cluster: Cluster, **changes: Any) -> Cluster:
    """Change a cluster's fields (the routing table is republished: it carries pools' datacenters). Raises
    ValidationError."""
    return _save(cluster, changes, publish=True)


def cluster_delete(*, cluster: Cluster) -> None:
    """Delete a cluster and its links (the routing table is republished). Raises ProtectedError (409) while it has
    pools."""
    with transaction.atomic():
        cluster.delete()
        routing_table_publish()


def router_create(**fields: Any) -> Router:
    """Register a router (admin). Raises ValidationError (name, http(s) base URL, cluster)."""
    return _save(Router(), fields)


def router_update(*, router: Router, **changes: Any) -> Router:
    """Change a registered router. Raises ValidationError."""
    return _save(router, changes)


def router_delete(*, router: Router) -> None:
    """Remove a router from the registry. Raises ProtectedError (409) while a rollout plan uses it."""
    with transaction.atomic():
        router.delete()


def cluster_link_create(**fields: Any) -> ClusterLink:
    """Create a link and republish the routing table (it carries the links). Raises ValidationError (same
    cluster twice, bandwidth <= 0, rtt < 0, duplicate pair)."""
    return _save(ClusterLink(), fields, publish=True)


def cluster_link_update(*, link: ClusterLink, **changes: Any) -> ClusterLink:
    """Change a link and republish the routing table. Raises ValidationError."""
    return _save(link, changes, publish=True)


def cluster_link_delete(*, link: ClusterLink) -> None:
    """Delete a link and republish the routing table."""
    with transaction.atomic():
        link.delete()
        routing_table_publish()


def pool_create(*, replicas: int, model_version: ModelVersion, **fields: Any) -> Pool:
    """Create a pool with one ``stable`` track of ``replicas`` running ``model_version``.

    Raises:
        ValidationError: invalid fields or replicas outside 0..10000.
    """
    validate_replica_count(replicas)
    pool = Pool(model_version=model_version, **fields)
    pool.full_clean()
    with transaction.atomic():
        pool.save()
        PoolTrack.objects.create(pool=pool, name=PoolTrack.Name.STABLE, model_version=model_version,
                                 replicas=replicas, weight=100, active=True)
    return pool


def pool_update(*, pool: Pool, **changes: Any) -> Pool:
    """Change a pool's row (its settings and ``model_version``). Its tracks are operations' to change: operators
    and the API call :func:`apps.operations.pools.pool_update`, which also moves the stable track.

    Raises:
        ValidationError: invalid fields.
        ConflictError: changing the model version or cluster while a hold is on the pool (an active
            rollout involves it; :mod:`apps.fleet.holds`).
    """
    moving = {f for f in ("model_version", "cluster") if f in changes and changes[f] != getattr(pool, f)}
    held_by = pool_hold_reason(pool) if moving else None
    if held_by is not None:
        raise ConflictError(f"Pool {pool} is part of {held_by}; finish or abort it before changing "
                            f"{', '.join(sorted(moving))}.")
    return _save(pool, changes)


REPLICA_OBSERVED_FIELDS = ("track", "endpoint", "ready", "alive", "version", "restart_count", "exit_code", "message",
                           "exited_at")
"""The ``Replica`` columns copied from an ``ObservedReplica`` (``last_seen`` is the refresh's time)."""


def replicas_refresh(*, pool: Pool, observed: Any) -> tuple[int, int]:
    """Make the pool's ``Replica`` rows match an ``ObservedState``; returns (upserted, deleted).

    ``last_seen`` is now for every observed replica; rows no longer observed are deleted. One pool of
    :func:`replicas_refresh_many`.
    """
    return replicas_refresh_many(observed={pool.pk: observed})


def _observed_fields(replica: Any, track: Any) -> dict[str, Any]:
    return {"track": replica.track or track.track, "endpoint": replica.endpoint,
            "ready": replica.ready and replica.alive, "alive": replica.alive, "version": replica.version,
            "restart_count": replica.restart_count, "exit_code": replica.exit_code, "message": replica.message,
            "exited_at": None if replica.exited_at is None else datetime.fromtimestamp(replica.exited_at, tz=UTC)}


def replicas_refresh_many(*, observed: dict[int, Any]) -> tuple[int, int]:
    """Make the ``Replica`` rows of several pools match their ``ObservedState`` (pool id -> state); returns
    (upserted, deleted) summed over the pools.

    For every observed replica the row gets the observed fields and ``last_seen`` = now; rows of these pools
    that are no longer observed are deleted (a replica observed twice keeps its last observation). Batched, so
    the statement count does not grow with the number of pools or replicas: one read of the pools' rows, one
    delete of the vanished, ``bulk_create`` of the new, ``bulk_update`` of the changed, and one ``UPDATE`` of
    ``last_seen`` — a steady fleet is 2 statements. One transaction.
    """
    now = timezone.now()
    wanted: dict[tuple[int, str], dict[str, Any]] = {}
    for pool_id, state in observed.items():
        for track in state.tracks.values():
            for replica in track.replicas:
                wanted[(pool_id, replica.name)] = _observed_fields(replica, track)
    with transaction.atomic():
        rows = Replica.objects.filter(pool_id__in=list(observed)).values_list("pk", "pool_id", "name",
                                                                               *REPLICA_OBSERVED_FIELDS)
        existing: dict[tuple[int, str], int] = {}
        vanished: list[int] = []
        changed: list[Replica] = []
        for pk, pool_id, name, *values in rows:
            fields = wanted.get((pool_id, name))
            if fields is None:
                vanished.append(pk)
                continue
            existing[(pool_id, name)] = pk
            if tuple(values) != tuple(fields[f] for f in REPLICA_OBSERVED_FIELDS):
                changed.append(Replica(pk=pk, last_seen=now, **fields))
        deleted = Replica.objects.filter(pk__in=vanished).delete()[0] if vanished else 0
        new = [Replica(pool_id=pool_id, name=name, last_seen=now, **fields)
               for (pool_id, name), fields in wanted.items() if (pool_id, name) not in existing]
        if new:
            Replica.objects.bulk_create(new, batch_size=1000)
        if changed:
            Replica.objects.bulk_update(changed, [*REPLICA_OBSERVED_FIELDS, "last_seen"], batch_size=500)
        if existing:
            Replica.objects.filter(pool_id__in=list(observed)).update(last_seen=now)
    return len(wanted), deleted


def routing_table_publish() -> tuple[RoutingTable, bool]:
    """Rebuild the routing table; bump its version only if the content changed. Returns (table, changed).

    The content includes the active client API keys' hashes (:func:`apps.accounts.selectors.client_keys_routed`):
    creating, rotating or revoking a key publishes a new version, and so does the end of a rotation's grace
    period (at the next reconcile tick).

    Concurrent publishers serialize on the row (``select_for_update``), so one change is one version. A new
    version is copied to the Redis cache routers are served from once the transaction commits
    (:mod:`apps.fleet.routing_table_cache`).
    """
    content = routing_table_content(selectors.routing_pools(), selectors.cluster_link_list(),
                                    threshold_tokens=settings.FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS,
                                    client_keys=client_keys_routed(now=timezone.now()))
    digest = content_digest(content)
    with transaction.atomic():
        table, created = RoutingTable.objects.select_for_update().get_or_create(
            pk=1, defaults={"version": 1, "digest": digest, "content": content})
        if created:
            transaction.on_commit(lambda: routing_table_cache_store(version=1, digest=digest, content=content,
                                                                    published_at=table.published_at))
            return table, True
        if table.digest == digest:
            return table, False
        table.version += 1
        table.digest, table.content = digest, content
        table.save()
        version, published_at = table.version, table.published_at
        transaction.on_commit(lambda: routing_table_cache_store(version=version, digest=digest, content=content,
                                                                published_at=published_at))
    return table, True
