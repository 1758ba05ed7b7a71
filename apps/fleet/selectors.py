"""Reads for the fleet, with the relations list endpoints need (constant query count)."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from apps.fleet.models import Cluster, ClusterLink, Pool, PoolTrack, Replica, Router, RoutingTable


def cluster_list() -> QuerySet[Cluster]:
    return Cluster.objects.all()


def router_list() -> QuerySet[Router]:
    return Router.objects.select_related("cluster")


def cluster_link_list() -> QuerySet[ClusterLink]:
    return ClusterLink.objects.select_related("source", "destination")


def pool_list() -> QuerySet[Pool]:
    return Pool.objects.select_related("cluster", "model_version").prefetch_related("tracks")


def replica_list() -> QuerySet[Replica]:
    """Observed replicas with their pool and cluster (one query)."""
    return Replica.objects.select_related("pool", "pool__cluster")


def replica_endpoint_rows() -> QuerySet:
    """``(pool_id, track, name, endpoint)`` of every alive observed replica with an endpoint (one query);
    telemetry's direct scrape reads them (:func:`apps.telemetry.endpoints.replica_endpoints`)."""
    return Replica.objects.filter(alive=True).exclude(endpoint="").values_list("pool_id", "track", "name", "endpoint")


def routing_pools() -> QuerySet[Pool]:
    """Pools with cluster, tracks (+ model versions) and ready replicas, for the routing table (4 queries).

    Replicas carry only the columns the table reads (:func:`apps.fleet.routing_table.routing_table_content`); a
    reconcile tick publishes the table, and at 1,000 pools that is 10,000 rows."""
    return Pool.objects.select_related("cluster").prefetch_related(
        Prefetch("tracks", queryset=PoolTrack.objects.select_related("model_version").order_by("name")),
        Prefetch("observed_replicas", queryset=Replica.objects.filter(ready=True, alive=True)
                 .exclude(endpoint="").order_by("name").only("pool_id", "name", "endpoint", "track", "version"),
                 to_attr="ready_replicas"),
    ).order_by("id")


def routing_table_current() -> RoutingTable | None:
    """The published routing table, or None before the first publish."""
    return RoutingTable.objects.filter(pk=1).first()
