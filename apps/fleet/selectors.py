"""Reads for the fleet, with the relations list endpoints need (constant query count)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import cache
from typing import Any, NamedTuple

from django.db.models import Prefetch, QuerySet

from apps.core.queries import PreparedQuery
from apps.fleet.models import Cluster, ClusterLink, Pool, PoolTrack, Replica, Router, RoutingTable


def cluster_list() -> QuerySet[Cluster]:
    return Cluster.objects.all()


def router_list() -> QuerySet[Router]:
    return Router.objects.select_related("cluster")


def cluster_link_list() -> QuerySet[ClusterLink]:
    return ClusterLink.objects.select_related("source", "destination")


def pool_list() -> QuerySet[Pool]:
    return Pool.objects.select_related("cluster", "model_version").prefetch_related("tracks")


def pool_list_serialized() -> QuerySet[Pool]:
    """Pools with their tracks, for what the API serializes (2 queries): the serializer writes the cluster and model
    version as ids, so their rows are not joined (issue 21: compiling and reading the two joined tables, the model
    version's JSON architecture included, was about a tenth of a ``GET /api/v1/pools/``)."""
    return Pool.objects.prefetch_related("tracks")


def pool_rows() -> QuerySet[Pool]:
    """Pools without relations, for ``GET /api/v1/pools/``: the view filters and orders them, then reads the
    serializer's columns with ``values()`` (:class:`apps.core.serializers.ValuesRepresentation`) and their tracks
    with :func:`pool_track_rows` (2 queries)."""
    return Pool.objects.all()


def pool_track_rows(*, pool_ids: Collection[int], columns: Sequence[str]) -> list[dict[str, Any]]:
    """``values(pool_id, *columns)`` of the tracks of the pools ``pool_ids`` (one query), in ``PoolTrack``'s
    order (pool, name): what ``prefetch_related("tracks")`` reads."""
    if not pool_ids:
        return []
    return list(PoolTrack.objects.filter(pool_id__in=pool_ids).values("pool_id", *columns))


@cache
def _pool_first_queries(ordering: tuple[str, ...], limit: int, columns: tuple[str, ...],
                        track_columns: tuple[str, ...]) -> tuple[PreparedQuery, PreparedQuery]:
    def first_ids() -> QuerySet:
        return pool_rows().order_by(*ordering).values("id")[:limit]

    def pools() -> QuerySet:
        return pool_rows().order_by(*ordering).values(*columns)[:limit]

    def tracks() -> QuerySet:
        return PoolTrack.objects.filter(pool_id__in=first_ids()).values("pool_id", *track_columns)

    return PreparedQuery(pools), PreparedQuery(tracks)


def pool_first_rows(*, ordering: Sequence[str], limit: int, columns: Sequence[str],
                    track_columns: Sequence[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first ``limit`` pools in ``ordering`` as ``values(*columns)``, and the tracks of those pools as
    :func:`pool_track_rows` gives them: 2 queries, built and compiled once per process and arguments
    (:class:`apps.core.queries.PreparedQuery`) — ``GET /api/v1/pools/`` without parameters, what routers and
    dashboards send. A pool created between the two queries may bring tracks of a pool not in the first list:
    callers match tracks to pools by ``pool_id``."""
    pools, tracks = _pool_first_queries(tuple(ordering), limit, tuple(columns), tuple(track_columns))
    return pools.rows(), tracks.rows()


def replica_list() -> QuerySet[Replica]:
    """Observed replicas with their pool and cluster (one query)."""
    return Replica.objects.select_related("pool", "pool__cluster")


def replica_endpoint_rows() -> QuerySet:
    """``(pool_id, track, name, endpoint, engine, pool name)`` of every alive observed replica with an endpoint (one
    query); telemetry's direct scrape reads them (:func:`apps.telemetry.endpoints.replica_endpoints`)."""
    return (Replica.objects.filter(alive=True).exclude(endpoint="")
            .values_list("pool_id", "track", "name", "endpoint", "pool__engine", "pool__name"))


class ReadyReplica(NamedTuple):
    """The columns of a ready replica the routing table reads."""

    name: str
    endpoint: str
    track: str
    version: str


def routing_pools() -> list[Pool]:
    """Pools with cluster, tracks (+ model versions) and ``ready_replicas`` (ready, alive, with an endpoint, by
    name), for the routing table (3 queries).

    ``ready_replicas`` are :class:`ReadyReplica` tuples read with ``values_list``, not model instances: a reconcile
    tick publishes the table, and at 1,000 pools building 10,000 ``Replica`` objects took 1.4 s of a 6.4 s tick
    (pyinstrument, load average 16).
    """
    pools = list(Pool.objects.select_related("cluster").prefetch_related(
        Prefetch("tracks", queryset=PoolTrack.objects.select_related("model_version").order_by("name")),
    ).order_by("id"))
    ready: dict[int, list[ReadyReplica]] = {}
    rows = (Replica.objects.filter(ready=True, alive=True).exclude(endpoint="").order_by("pool_id", "name")
            .values_list("pool_id", "name", "endpoint", "track", "version"))
    for pool_id, name, endpoint, track, version in rows:
        ready.setdefault(pool_id, []).append(ReadyReplica(name, endpoint, track, version))
    for pool in pools:
        pool.ready_replicas = ready.get(pool.pk, [])
    return pools


def routing_table_current() -> RoutingTable | None:
    """The published routing table, or None before the first publish."""
    return RoutingTable.objects.filter(pk=1).first()
