"""Routes of the telemetry API."""

from rest_framework.routers import SimpleRouter

from apps.telemetry.api.views import AlertRuleViewSet, AlertViewSet, SignalsViewSet

router = SimpleRouter()
router.register("alert-rules", AlertRuleViewSet, basename="alert-rule")
router.register("alerts", AlertViewSet, basename="alert")
router.register("signals", SignalsViewSet, basename="signals")
urlpatterns = router.urls
