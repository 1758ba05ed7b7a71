"""``/api/v1/actions/``: the audit log (read-only), plus ``retry`` and ``cancel`` (operator)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.roles import OPERATOR
from apps.core.idempotency import HEADER, idempotency_key_from_request
from apps.operations import selectors, services
from apps.operations.api.filtersets import ActionFilterSet
from apps.operations.api.serializers import ActionSerializer


class ActionViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = ActionSerializer
    filterset_class = ActionFilterSet
    ordering_fields = ["created_at", "status", "kind"]
    ordering = ["-created_at", "-id"]
    action_roles = {"retry": OPERATOR, "cancel": OPERATOR}

    def get_queryset(self):
        return selectors.action_list()

    @extend_schema(request=None, responses={200: ActionSerializer, 201: ActionSerializer},
                   parameters=[OpenApiParameter(HEADER, str, OpenApiParameter.HEADER, required=False)])
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        """Create a new pending Action repeating a failed or cancelled one (409 otherwise)."""
        new, created = services.action_retry(action=self.get_object(), requested_by=request.user,
                                             idempotency_key=idempotency_key_from_request(request))
        return Response(ActionSerializer(new).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=None, responses=ActionSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel a pending Action (409 once it is running or finished)."""
        cancelled = services.action_cancel(action=self.get_object(), cancelled_by=request.user)
        return Response(ActionSerializer(cancelled).data)
