"""Routes of the fleet API (pools and replicas: :mod:`apps.operations.api.urls`)."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.fleet.api.views import ClusterLinkViewSet, ClusterViewSet, RouterViewSet, RoutingTableView

router = SimpleRouter()
router.register("clusters", ClusterViewSet, basename="cluster")
router.register("cluster-links", ClusterLinkViewSet, basename="cluster-link")
router.register("routers", RouterViewSet, basename="router")
urlpatterns = [path("routing-table/", RoutingTableView.as_view(), name="routing-table"), *router.urls]
