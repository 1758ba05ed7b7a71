"""Routes of the rollouts API."""

from rest_framework.routers import SimpleRouter

from apps.rollouts.api.views import GateMeasurementViewSet, RolloutPlanViewSet

router = SimpleRouter()
router.register("rollouts", RolloutPlanViewSet, basename="rollout")
router.register("rollout-measurements", GateMeasurementViewSet, basename="rollout-measurement")
urlpatterns = router.urls
