"""Routes of the operations API."""

from rest_framework.routers import SimpleRouter

from apps.operations.api.alerts import AlertViewSet
from apps.operations.api.client_keys import ClientApiKeyViewSet
from apps.operations.api.views import ActionViewSet, PoolViewSet, ReplicaViewSet

router = SimpleRouter()
router.register("actions", ActionViewSet, basename="action")
router.register("pools", PoolViewSet, basename="pool")
router.register("replicas", ReplicaViewSet, basename="replica")
router.register("client-keys", ClientApiKeyViewSet, basename="client-key")
router.register("alerts", AlertViewSet, basename="alert")
urlpatterns = router.urls
