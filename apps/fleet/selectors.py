"""Reads for the fleet, with the relations list endpoints need (constant query count)."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from apps.fleet.models import Cluster, ClusterLink, Pool, PoolTrack, Replica, RoutingTable


def cluster_list() -> QuerySet[Cluster]:
    return Cluster.objects.all()


def cluster_link_list() -> QuerySet[ClusterLink]:
    return ClusterLink.objects.select_related("source", "destination")


def pool_list() -> QuerySet[Pool]:
    return Pool.objects.select_related("cluster", "model_version").prefetch_related("tracks")


def replica_list() -> QuerySet[Replica]:
    """Observed replicas with their pool and cluster (one query)."""
    return Replica.objects.select_related("pool", "pool__cluster")


def replica_logs(*, replica: Replica, tail: int) -> list[str]:
    """The last ``tail`` lines of ``replica``'s stdout/stderr, read from its cluster's backend.

    Raises:
        apps.orchestrators.base.NotFound: the backend no longer has that replica.
        apps.orchestrators.base.BackendUnavailable: the backend cannot be reached.
        apps.orchestrators.base.InvalidSpec: the cluster's backend is not configured (e.g. no agent token).
    """
    from apps.operations.backends import backend_session, pool_ref  # operations builds on fleet, not back

    with backend_session(replica.pool.cluster) as backend:
        text = backend.logs(pool_ref(replica.pool), replica.name, tail)
    return text.splitlines()[-tail:]


def replica_endpoints() -> list:
    """Telemetry's endpoint provider: every observed replica with an endpoint, plus the static targets.

    Returns ``apps.telemetry.endpoints.ReplicaEndpoint`` items (pool id as a string), live Replica
    rows first; a static target with the same (pool, track, replica) key is dropped.
    """
    from apps.telemetry.endpoints import ReplicaEndpoint, static_endpoints

    found = {}
    for pool_id, track, name, endpoint in (Replica.objects.filter(alive=True).exclude(endpoint="")
                                           .values_list("pool_id", "track", "name", "endpoint")):
        ep = ReplicaEndpoint(pool_id=str(pool_id), track=track, replica=name, url=endpoint)
        found[ep.key] = ep
    for ep in static_endpoints():
        found.setdefault(ep.key, ep)
    return list(found.values())


def routing_pools() -> QuerySet[Pool]:
    """Pools with cluster, tracks (+ model versions) and ready replicas, for the routing table (4 queries)."""
    return Pool.objects.select_related("cluster").prefetch_related(
        Prefetch("tracks", queryset=PoolTrack.objects.select_related("model_version").order_by("name")),
        Prefetch("observed_replicas", queryset=Replica.objects.filter(ready=True, alive=True)
                 .exclude(endpoint="").order_by("name"), to_attr="ready_replicas"),
    ).order_by("id")


def routing_table_current() -> RoutingTable | None:
    """The published routing table, or None before the first publish."""
    return RoutingTable.objects.filter(pk=1).first()
