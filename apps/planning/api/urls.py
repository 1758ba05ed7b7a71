"""Routes of the planning API."""

from rest_framework.routers import SimpleRouter

from apps.planning.api.views import PlanViewSet, ProfileViewSet

router = SimpleRouter()
router.register("profiles", ProfileViewSet, basename="profile")
router.register("plans", PlanViewSet, basename="plan")
urlpatterns = router.urls
