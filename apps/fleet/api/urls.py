"""Routes of the fleet API."""

from rest_framework.routers import SimpleRouter

from apps.fleet.api.views import ClusterLinkViewSet, ClusterViewSet, PoolViewSet

router = SimpleRouter()
router.register("clusters", ClusterViewSet, basename="cluster")
router.register("cluster-links", ClusterLinkViewSet, basename="cluster-link")
router.register("pools", PoolViewSet, basename="pool")
urlpatterns = router.urls
