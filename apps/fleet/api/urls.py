"""Routes of the fleet API."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.fleet.api.views import (
    ClusterLinkViewSet,
    ClusterViewSet,
    PoolViewSet,
    ReplicaViewSet,
    RoutingTableView,
)

router = SimpleRouter()
router.register("clusters", ClusterViewSet, basename="cluster")
router.register("cluster-links", ClusterLinkViewSet, basename="cluster-link")
router.register("pools", PoolViewSet, basename="pool")
router.register("replicas", ReplicaViewSet, basename="replica")
urlpatterns = [path("routing-table/", RoutingTableView.as_view(), name="routing-table"), *router.urls]
