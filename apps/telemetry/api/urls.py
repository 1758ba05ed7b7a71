"""Routes of the telemetry API. ``/api/v1/alerts/`` is routed by operations (``apps.operations.api.urls``), whose
viewset adds the operator verbs that write the audit log (acknowledge, silence, unsilence)."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.telemetry.api.views import AlertRuleViewSet, LinkLoadView, SignalsViewSet

router = SimpleRouter()
router.register("alert-rules", AlertRuleViewSet, basename="alert-rule")
router.register("signals", SignalsViewSet, basename="signals")
urlpatterns = [path("link-load/", LinkLoadView.as_view(), name="link-load"), *router.urls]
