"""Reads for the fleet, with the relations list endpoints need (constant query count)."""

from django.db.models import QuerySet

from apps.fleet.models import Cluster, ClusterLink, Pool


def cluster_list() -> QuerySet[Cluster]:
    return Cluster.objects.all()


def cluster_link_list() -> QuerySet[ClusterLink]:
    return ClusterLink.objects.select_related("source", "destination")


def pool_list() -> QuerySet[Pool]:
    return Pool.objects.select_related("cluster", "model_version").prefetch_related("tracks")
