"""Routes of the rollouts API."""

from rest_framework.routers import SimpleRouter

from apps.rollouts.api.views import RolloutPlanViewSet

router = SimpleRouter()
router.register("rollouts", RolloutPlanViewSet, basename="rollout")
urlpatterns = router.urls
