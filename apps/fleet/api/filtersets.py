"""Filters for the fleet endpoints."""

import django_filters

from apps.fleet.models import Cluster, ClusterLink, Pool, Replica


class ClusterFilterSet(django_filters.FilterSet):
    name_contains = django_filters.CharFilter(field_name="name", lookup_expr="icontains")

    class Meta:
        model = Cluster
        fields = ["name", "kind", "datacenter", "status"]


class ClusterLinkFilterSet(django_filters.FilterSet):
    class Meta:
        model = ClusterLink
        fields = ["source", "destination"]


class PoolFilterSet(django_filters.FilterSet):
    cluster_name = django_filters.CharFilter(field_name="cluster__name")

    class Meta:
        model = Pool
        fields = ["name", "cluster", "role", "model_version", "autoscaling_enabled"]


class ReplicaFilterSet(django_filters.FilterSet):
    cluster = django_filters.NumberFilter(field_name="pool__cluster")
    pool_name = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = Replica
        fields = ["pool", "track", "ready", "alive", "version"]
