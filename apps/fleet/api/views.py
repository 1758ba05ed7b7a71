"""``/api/v1/clusters/``, ``/api/v1/cluster-links/`` and ``GET /api/v1/routing-table/`` (router, service
token, ETag). ``/api/v1/pools/`` and ``/api/v1/replicas/`` are served by operations (their delete, scale and
logs reach a backend: :mod:`apps.operations.api.views`).

Writes need the admin role. Views call services and selectors only.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status, viewsets
from rest_framework.authentication import SessionAuthentication
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.authentication import TokenAuthentication
from apps.accounts.roles import ADMIN
from apps.fleet import selectors, services
from apps.fleet.api.auth import IsServiceOrViewer, ServiceTokenAuthentication, is_service
from apps.fleet.api.filtersets import ClusterFilterSet, ClusterLinkFilterSet, RouterFilterSet
from apps.fleet.api.serializers import ClusterLinkSerializer, ClusterSerializer, RouterSerializer
from apps.fleet.routing_table import content_redacted
from apps.fleet.routing_table_cache import routing_table_cache_store, routing_table_etag


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


class RouterViewSet(viewsets.ModelViewSet):
    """The router registry: the only router URLs the control plane fetches (admin writes, viewers read)."""

    serializer_class = RouterSerializer
    filterset_class = RouterFilterSet
    ordering_fields = ["name", "created_at"]
    ordering = ["name"]
    write_role = ADMIN

    def get_queryset(self):
        return selectors.router_list()

    def perform_create(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = services.router_create(**serializer.validated_data)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = services.router_update(router=serializer.instance, **serializer.validated_data)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        services.router_delete(router=instance)


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


class RoutingTableView(APIView):
    """``GET /api/v1/routing-table/``: the published table for the router, with ``ETag`` / ``If-None-Match``.

    Authenticated by the service token (``Authorization: Bearer``), a ``service`` user's token or a
    viewer; a viewer's copy has no worker tokens and no client keys (:func:`apps.fleet.routing_table.content_redacted`). Before the first reconcile tick the table is published on demand. The service token's polls are
    answered before Django from the Redis copy each answer here refreshes (:mod:`apps.fleet.routing_table_cache`).
    """

    authentication_classes = [ServiceTokenAuthentication, TokenAuthentication, SessionAuthentication]
    permission_classes = [IsServiceOrViewer]

    @staticmethod
    def etag(version: int, digest: str) -> str:
        return routing_table_etag(version, digest)

    @extend_schema(responses={200: OpenApiTypes.OBJECT, 304: OpenApiResponse(description="Not modified")},
                   parameters=[OpenApiParameter("If-None-Match", str, OpenApiParameter.HEADER, required=False)])
    def get(self, request: Request) -> Response:
        table = selectors.routing_table_current()
        if table is None:
            table, _ = services.routing_table_publish()
        etag = self.etag(table.version, table.digest)
        # refill the cache the ASGI fast path serves routers from (apps.fleet.routing_table_cache)
        routing_table_cache_store(version=table.version, digest=table.digest, content=table.content,
                                  published_at=table.published_at)
        candidates = [tag.strip() for tag in request.headers.get("If-None-Match", "").split(",")]
        if etag in candidates or "*" in candidates:
            return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        content = table.content if is_service(request.user) else content_redacted(table.content)
        return Response({"version": table.version, **content}, headers={"ETag": etag})
