"""``/api/v1/clusters/``, ``/api/v1/cluster-links/``, ``/api/v1/pools/`` (+ ``POST pools/{id}/scale/``),
``/api/v1/replicas/`` (observed, read-only) and ``GET /api/v1/routing-table/`` (router, service token, ETag).

Writes need the admin role except ``scale`` (operator). Views call services and selectors only.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status, viewsets
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.roles import ADMIN, OPERATOR
from apps.core.idempotency import HEADER, idempotency_key_from_request
from apps.fleet import selectors, services
from apps.fleet.api.auth import IsServiceOrViewer, ServiceTokenAuthentication
from apps.fleet.api.filtersets import ClusterFilterSet, ClusterLinkFilterSet, PoolFilterSet, ReplicaFilterSet
from apps.fleet.api.serializers import (
    ClusterLinkSerializer,
    ClusterSerializer,
    PoolScaleSerializer,
    PoolSerializer,
    ReplicaSerializer,
)
from apps.operations.api.serializers import ActionSerializer

IDEMPOTENCY_PARAMETER = OpenApiParameter(
    HEADER, str, OpenApiParameter.HEADER, required=False,
    description="Repeat a request safely: the same key returns the first Action (200) instead of a new one.",
)


class ClusterViewSet(viewsets.ModelViewSet):
    serializer_class = ClusterSerializer
    filterset_class = ClusterFilterSet
    ordering_fields = ["name", "kind", "datacenter", "created_at"]
    ordering = ["name"]
    write_role = ADMIN

    def get_queryset(self):
        return selectors.cluster_list()

    def perform_create(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = services.cluster_create(**serializer.validated_data)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = services.cluster_update(cluster=serializer.instance, **serializer.validated_data)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        services.cluster_delete(cluster=instance)


class ClusterLinkViewSet(viewsets.ModelViewSet):
    serializer_class = ClusterLinkSerializer
    filterset_class = ClusterLinkFilterSet
    ordering_fields = ["bandwidth_gbps", "rtt_ms", "created_at"]
    ordering = ["id"]
    write_role = ADMIN

    def get_queryset(self):
        return selectors.cluster_link_list()

    def perform_create(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = services.cluster_link_create(**serializer.validated_data)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = services.cluster_link_update(link=serializer.instance, **serializer.validated_data)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        services.cluster_link_delete(link=instance)


class PoolViewSet(viewsets.ModelViewSet):
    serializer_class = PoolSerializer
    filterset_class = PoolFilterSet
    ordering_fields = ["name", "role", "created_at"]
    ordering = ["id"]
    write_role = ADMIN
    action_roles = {"scale": OPERATOR}

    def get_queryset(self):
        return selectors.pool_list()

    def perform_create(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        pool = services.pool_create(**serializer.validated_data)
        serializer.instance = selectors.pool_list().get(pk=pool.pk)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        pool = services.pool_update(pool=serializer.instance, **serializer.validated_data)
        serializer.instance = selectors.pool_list().get(pk=pool.pk)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        services.pool_delete(pool=instance)

    @extend_schema(request=PoolScaleSerializer, responses={200: ActionSerializer, 201: ActionSerializer},
                   parameters=[IDEMPOTENCY_PARAMETER])
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: str | None = None) -> Response:
        """Request a new total replica count: creates a pending ``pool.scale`` Action (409 if the pool is busy)."""
        pool = self.get_object()
        serializer = PoolScaleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        act, created = services.pool_scale(
            pool=pool, replicas=serializer.validated_data["replicas"], requested_by=request.user,
            idempotency_key=idempotency_key_from_request(request),
        )
        return Response(ActionSerializer(act).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    """Observed replicas, refreshed by reconcile from the backends (read-only)."""

    serializer_class = ReplicaSerializer
    filterset_class = ReplicaFilterSet
    ordering_fields = ["name", "last_seen", "track"]
    ordering = ["pool_id", "track", "name"]

    def get_queryset(self):
        return selectors.replica_list()

    @extend_schema(
        parameters=[OpenApiParameter("tail", OpenApiTypes.INT, description="lines to return, 1..5000 (default 200)")],
        responses={200: OpenApiResponse(description='{"replica": name, "lines": [...]}'), 400: None, 404: None,
                   503: None},
    )
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, pk: str | None = None) -> Response:
        """``GET /api/v1/replicas/{id}/logs/?tail=N``: the replica's last log lines from its backend."""
        from apps.orchestrators.base import BackendUnavailable, InvalidSpec, NotFound

        replica = self.get_object()
        raw = request.query_params.get("tail", "200")
        if not raw.isdigit() or not 1 <= int(raw) <= 5000:
            return Response({"tail": [f"must be an integer from 1 to 5000, got {raw!r}"]},
                            status=status.HTTP_400_BAD_REQUEST)
        try:
            lines = selectors.replica_logs(replica=replica, tail=int(raw))
        except NotFound:
            return Response({"detail": f"the backend no longer has replica {replica.name!r}"},
                            status=status.HTTP_404_NOT_FOUND)
        except (BackendUnavailable, InvalidSpec) as exc:
            return Response({"detail": f"logs of {replica.name!r} are unavailable: {exc}"},
                            status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response({"replica": replica.name, "lines": lines})


class RoutingTableView(APIView):
    """``GET /api/v1/routing-table/``: the published table for the router, with ``ETag`` / ``If-None-Match``.

    Authenticated by the service token (``Authorization: Bearer``), a ``service`` user's token or a
    viewer. Before the first reconcile tick the table is published on demand.
    """

    authentication_classes = [ServiceTokenAuthentication, TokenAuthentication, SessionAuthentication]
    permission_classes = [IsServiceOrViewer]

    @staticmethod
    def etag(version: int, digest: str) -> str:
        return f'"{version}-{digest[:16]}"'

    @extend_schema(responses={200: OpenApiTypes.OBJECT, 304: OpenApiResponse(description="Not modified")},
                   parameters=[OpenApiParameter("If-None-Match", str, OpenApiParameter.HEADER, required=False)])
    def get(self, request: Request) -> Response:
        table = selectors.routing_table_current()
        if table is None:
            table, _ = services.routing_table_publish()
        etag = self.etag(table.version, table.digest)
        candidates = [tag.strip() for tag in request.headers.get("If-None-Match", "").split(",")]
        if etag in candidates or "*" in candidates:
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return Response({"version": table.version, **table.content}, headers={"ETag": etag})
