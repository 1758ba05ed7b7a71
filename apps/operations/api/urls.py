"""Routes of the operations API."""

from rest_framework.routers import SimpleRouter

from apps.operations.api.views import ActionViewSet

router = SimpleRouter()
router.register("actions", ActionViewSet, basename="action")
urlpatterns = router.urls
