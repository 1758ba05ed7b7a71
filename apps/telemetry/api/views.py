"""``/api/v1/alert-rules/`` (admin writes), ``/api/v1/alerts/`` (read-only) and
``/api/v1/signals/`` (the poller's latest signals: fleet, ``{pool_id}/``, ``{pool_id}/history/``) and
``/api/v1/link-load/`` (the links' measured KV load).

Views call selectors and services only.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, viewsets
from rest_framework.authentication import SessionAuthentication
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.authentication import TokenAuthentication
from apps.accounts.roles import ADMIN
from apps.core.filters import query_float
from apps.fleet.api.auth import IsServiceOrViewer, ServiceTokenAuthentication
from apps.fleet.models import Pool
from apps.telemetry import selectors, services
from apps.telemetry.api.filtersets import AlertFilterSet, AlertRuleFilterSet
from apps.telemetry.api.serializers import AlertRuleSerializer, AlertSerializer
from apps.telemetry.models import AlertRule

# The latest Unix time a ?since= may name (year 9999): beyond it a float no longer names a second.
MAX_UNIX_TIME_S = 253402300799.0


def _service(call, **kwargs):
    try:
        return call(**kwargs)
    except DjangoValidationError as exc:
        raise ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages) from exc


class AlertRuleViewSet(viewsets.ModelViewSet):
    serializer_class = AlertRuleSerializer
    filterset_class = AlertRuleFilterSet
    ordering_fields = ["name", "severity", "threshold", "created_at"]
    ordering = ["name", "id"]
    write_role = ADMIN

    def get_queryset(self):
        return AlertRule.objects.all()

    def perform_create(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = _service(services.alert_rule_create, **serializer.validated_data)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = _service(services.alert_rule_update, rule=serializer.instance,
                                       **serializer.validated_data)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        services.alert_rule_delete(rule=instance)


class AlertViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = AlertSerializer
    filterset_class = AlertFilterSet
    ordering_fields = ["started_at", "ended_at", "severity"]
    ordering = ["-started_at"]

    def get_queryset(self):
        return selectors.alert_list()


POOL_ID = OpenApiParameter("id", int, OpenApiParameter.PATH, description="The pool's id.")


class SignalsViewSet(viewsets.ViewSet):
    """Latest signals and their 15-minute history, as the poller stored them in Redis."""

    serializer_class = serializers.Serializer  # free-form JSON documents (see selectors)
    lookup_value_regex = r"[0-9]+"

    @extend_schema(operation_id="signals_fleet", responses={200: dict},
                   description="The fleet's latest record: pool id -> signals, with seq.")
    def list(self, request: Request) -> Response:
        return Response(selectors.telemetry_snapshot(pool_id=None) or {})

    @extend_schema(operation_id="signals_pool", responses={200: dict}, parameters=[POOL_ID],
                   description="A pool's latest record: signals, per-track signals, seq.")
    def retrieve(self, request: Request, pk: str) -> Response:
        pool = get_object_or_404(Pool, pk=pk)
        return Response(selectors.telemetry_snapshot(pool_id=pool.pk) or {})

    @extend_schema(
        operation_id="signals_pool_history",
        responses={200: dict},
        parameters=[POOL_ID,
                    OpenApiParameter("since", {"type": "number", "format": "double", "minimum": 0,
                                                  "maximum": MAX_UNIX_TIME_S},
                                     description="Only records at or after this Unix time (s).")],
        description="A pool's records of the last 15 minutes, oldest first.",
    )
    @action(detail=True, methods=["get"])
    def history(self, request: Request, pk: str) -> Response:
        pool = get_object_or_404(Pool, pk=pk)
        since = query_float(request.query_params, "since", min_value=0.0, max_value=MAX_UNIX_TIME_S)
        return Response({"pool_id": pool.pk, "records": selectors.telemetry_history(pool_id=pool.pk, since_s=since)})


class LinkLoadView(APIView):
    """``GET /api/v1/link-load/``: each cluster link's measured KV load (Gbit/s, utilisation), refreshed every poll
    (:mod:`apps.telemetry.link_load`), for routers' bandwidth-aware PD decision and for viewers.

    The service token's polls are answered before Django from Redis (:mod:`apps.fleet.routing_table_cache`); this
    view serves the same stored document to the others. 404 when no poller has stored a current one.
    """

    authentication_classes = [ServiceTokenAuthentication, TokenAuthentication, SessionAuthentication]
    permission_classes = [IsServiceOrViewer]

    @extend_schema(responses={200: OpenApiTypes.OBJECT, 404: OpenApiResponse(description="No measurement yet")})
    def get(self, request: Request) -> Response:
        document = selectors.link_load_current()
        if document is None:
            raise NotFound("No link load measured yet: the telemetry poller stores one every second while it runs.")
        return Response(document)
