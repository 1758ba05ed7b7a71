"""Filters for the fleet endpoints."""

import django_filters

from apps.core.filters import FilterSet
from apps.fleet.models import Cluster, ClusterLink, Pool, Replica, Router


class ClusterFilterSet(FilterSet):
    name_contains = django_filters.CharFilter(field_name="name", lookup_expr="icontains")

    class Meta:
        model = Cluster
        fields = ["name", "kind", "datacenter", "status"]


class RouterFilterSet(FilterSet):
    class Meta:
        model = Router
        fields = ["name", "cluster"]


class ClusterLinkFilterSet(FilterSet):
    class Meta:
        model = ClusterLink
        fields = ["source", "destination"]


class PoolFilterSet(FilterSet):
    cluster_name = django_filters.CharFilter(field_name="cluster__name")

    class Meta:
        model = Pool
        fields = ["name", "cluster", "role", "model_version", "autoscaling_enabled"]


class ReplicaFilterSet(FilterSet):
    cluster = django_filters.NumberFilter(field_name="pool__cluster")
    pool_name = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = Replica
        fields = ["pool", "track", "ready", "alive", "version"]
