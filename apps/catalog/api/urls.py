"""Routes of the catalog API."""

from rest_framework.routers import SimpleRouter

from apps.catalog.api.views import ModelVersionViewSet

router = SimpleRouter()
router.register("model-versions", ModelVersionViewSet, basename="model-version")
urlpatterns = router.urls
