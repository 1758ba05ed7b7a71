"""``/api/v1/alerts/``: telemetry's read-only alert list plus the operator verbs ``acknowledge``, ``silence`` and
``unsilence`` (:mod:`apps.operations.alerts`), each recorded in the audit log (``/api/v1/actions/``).

Routed here rather than in telemetry because each verb writes an Action (operations' layer). Viewers read;
the verbs need the operator role (403 otherwise). Every verb answers with the alert as it is now, or 400 naming a
field it does not take (``acknowledge`` and ``unsilence`` take none), doing nothing then.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.roles import OPERATOR
from apps.core.serializers import empty_body_check
from apps.operations import alerts
from apps.telemetry.api.serializers import AlertSerializer, AlertSilenceRequestSerializer
from apps.telemetry.api.views import AlertViewSet as TelemetryAlertViewSet


class AlertViewSet(TelemetryAlertViewSet):
    action_roles = {"acknowledge": OPERATOR, "silence": OPERATOR, "unsilence": OPERATOR}

    def _current(self, pk: str) -> Response:
        return Response(AlertSerializer(self.get_queryset().get(pk=pk)).data)

    @extend_schema(request=None, responses=AlertSerializer)
    @action(detail=True, methods=["post"])
    def acknowledge(self, request: Request, pk: str | None = None) -> Response:
        """Acknowledge a firing alert (409 once it has resolved; repeating it changes nothing; 400 when the body
        carries a field)."""
        empty_body_check(request.data)
        alerts.alert_acknowledge(alert=self.get_object(), user=request.user)
        return self._current(pk)

    @extend_schema(request=AlertSilenceRequestSerializer, responses=AlertSerializer)
    @action(detail=True, methods=["post"])
    def silence(self, request: Request, pk: str | None = None) -> Response:
        """Silence the alert's rule on its pool for ``duration_s`` seconds: no webhook notification meanwhile."""
        body = AlertSilenceRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            alerts.alert_silence(alert=self.get_object(), user=request.user, **body.validated_data)
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages) from exc
        return self._current(pk)

    @extend_schema(request=None, responses=AlertSerializer)
    @action(detail=True, methods=["post"])
    def unsilence(self, request: Request, pk: str | None = None) -> Response:
        """End the silences in effect for the alert's rule on its pool (nothing to end: unchanged, 200; 400 when the
        body carries a field)."""
        empty_body_check(request.data)
        alerts.alert_unsilence(alert=self.get_object(), user=request.user)
        return self._current(pk)
