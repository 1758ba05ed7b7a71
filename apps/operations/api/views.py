"""``/api/v1/actions/``: the audit log (read-only), plus ``retry`` and ``cancel`` (operator);
``/api/v1/pools/`` (+ ``POST pools/{id}/scale/`` and ``POST pools/{id}/flush-kv-cache/``) and ``/api/v1/replicas/`` (observed, read-only, + ``logs``).

Pools live here rather than in fleet because deleting and scaling one records an Action and reading a
replica's logs calls its backend; creating and updating a pool go through fleet's services. Writes need
the admin role except ``scale`` and ``flush-kv-cache`` (operator). Views call services and selectors only.

Every verb answers 400 naming a field it does not take (``retry``, ``cancel`` and ``flush-kv-cache`` take none), and
does nothing then.
"""

from __future__ import annotations

import logging

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.filters import OrderingFilter
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.roles import ADMIN, OPERATOR
from apps.core.filters import FilterBackend, query_int
from apps.core.idempotency import HEADER, idempotency_key_from_request
from apps.core.serializers import empty_body_check
from apps.fleet import selectors as fleet_selectors
from apps.fleet import services as fleet_services
from apps.fleet.api.filtersets import PoolFilterSet, ReplicaFilterSet
from apps.fleet.api.serializers import (
    PoolScaleSerializer,
    PoolSerializer,
    PoolWorkerTokenRotateSerializer,
    ReplicaSerializer,
    pool_list_representation,
    pool_values_representation,
)
from apps.operations import pools, selectors, services
from apps.operations.api.filtersets import ActionFilterSet
from apps.operations.api.serializers import ActionSerializer
from apps.orchestrators.base import BackendError, InvalidSpec, NotFound

logger = logging.getLogger(__name__)
MAX_LOG_TAIL_LINES = 5000

IDEMPOTENCY_PARAMETER = OpenApiParameter(
    HEADER, str, OpenApiParameter.HEADER, required=False,
    description="Repeat a request safely: the same key returns the first Action (200) instead of a new one.",
)


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
        """Create a new pending Action repeating a failed or cancelled one (409 otherwise; 400 when the body carries a
        field)."""
        empty_body_check(request.data)
        new, created = services.action_retry(action=self.get_object(), requested_by=request.user,
                                             idempotency_key=idempotency_key_from_request(request))
        return Response(ActionSerializer(new).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=None, responses=ActionSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel a pending Action (409 once it is running or finished; 400 when the body carries a field)."""
        empty_body_check(request.data)
        cancelled = services.action_cancel(action=self.get_object(), cancelled_by=request.user)
        return Response(ActionSerializer(cancelled).data)


FIRST_PAGE_FILTER_BACKENDS = (FilterBackend, OrderingFilter)
"""The filter backends under which a list request without parameters is the first page of every row in the view's
``ordering`` (a backend that filtered without parameters would make that untrue)."""


class PoolViewSet(viewsets.ModelViewSet):
    serializer_class = PoolSerializer
    filterset_class = PoolFilterSet
    ordering_fields = ["name", "role", "created_at"]
    ordering = ["id"]
    write_role = ADMIN
    action_roles = {"scale": OPERATOR, "flush_kv_cache": OPERATOR}

    def get_queryset(self):
        if self.action == "list":  # rows read with values() (list below)
            return fleet_selectors.pool_rows()
        if self.action == "retrieve":  # ids only, no joined cluster and model version
            return fleet_selectors.pool_list_serialized()
        return fleet_selectors.pool_list()

    def list(self, request: Request, *args, **kwargs) -> Response:  # noqa: ANN002, ANN003 - DRF signature
        """DRF's list (the same filters, ordering and pagination) with the page read as ``values()`` rows and
        represented as :class:`PoolSerializer` does (:func:`apps.fleet.api.serializers.pool_list_representation`):
        no model instances and no serializer fields built per request (issue 21: per-request cost; the API
        test compares both byte for byte).

        Without query parameters (routers, dashboards) the first page is read with queries compiled once per
        process (:func:`apps.fleet.selectors.pool_first_rows`); when it holds every pool, DRF's paginator answers
        from those rows (no ``COUNT``, as :class:`apps.core.pagination.FirstPagePaginator` does), else the list
        goes the general way below.
        """
        pool_representation, track_representation = pool_values_representation()
        if (not request.query_params and self.paginator is not None
                and tuple(self.filter_backends) == FIRST_PAGE_FILTER_BACKENDS):
            page_size = self.paginator.get_page_size(request)
            rows, tracks = fleet_selectors.pool_first_rows(
                ordering=self.ordering, limit=page_size + 1, columns=pool_representation.columns,
                track_columns=track_representation.columns)
            if len(rows) <= page_size:  # the whole list: its length is the count
                page = self.paginate_queryset(rows)
                return self.get_paginated_response(pool_list_representation(page, tracks))
        queryset = self.filter_queryset(self.get_queryset()).values(*pool_representation.columns)
        page = self.paginate_queryset(queryset)
        rows = list(queryset) if page is None else page
        tracks = fleet_selectors.pool_track_rows(pool_ids=[row["id"] for row in rows],
                                                 columns=track_representation.columns)
        data = pool_list_representation(rows, tracks)
        return Response(data) if page is None else self.get_paginated_response(data)

    def perform_create(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        pool = fleet_services.pool_create(**serializer.validated_data)
        serializer.instance = fleet_selectors.pool_list().get(pk=pool.pk)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        pool = pools.pool_update(pool=serializer.instance, requested_by=self.request.user,
                                 **serializer.validated_data)
        serializer.instance = fleet_selectors.pool_list().get(pk=pool.pk)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        pools.pool_delete(pool=instance, requested_by=self.request.user)

    @extend_schema(request=PoolScaleSerializer, responses={200: ActionSerializer, 201: ActionSerializer},
                   parameters=[IDEMPOTENCY_PARAMETER])
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: str | None = None) -> Response:
        """Request a new total replica count: creates a pending ``pool.scale`` Action (409 if the pool is busy; 400
        naming a missing or invalid ``replicas`` or an unknown field)."""
        pool = self.get_object()
        serializer = PoolScaleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        act, created = pools.pool_scale(
            pool=pool, replicas=serializer.validated_data["replicas"], requested_by=request.user,
            idempotency_key=idempotency_key_from_request(request),
        )
        return Response(ActionSerializer(act).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=None, responses={200: ActionSerializer, 201: ActionSerializer},
                   parameters=[IDEMPOTENCY_PARAMETER])
    @action(detail=True, methods=["post"], url_path="flush-kv-cache")
    def flush_kv_cache(self, request: Request, pk: str | None = None) -> Response:
        """Flush every running replica's prefix cache: creates a pending ``pool.flush_kv_cache`` Action that calls
        each worker's signed ``POST /admin/kv-cache/reset`` (409 if the pool is busy; a failure is recorded on the
        Action with each replica's reason and can be retried; 400 when the body carries a field)."""
        empty_body_check(request.data)
        act, created = pools.pool_flush_kv_cache(pool=self.get_object(), requested_by=request.user,
                                                 idempotency_key=idempotency_key_from_request(request))
        return Response(ActionSerializer(act).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


    @extend_schema(request=PoolWorkerTokenRotateSerializer, responses={200: ActionSerializer, 201: ActionSerializer},
                   parameters=[IDEMPOTENCY_PARAMETER])
    @action(detail=True, methods=["post"], url_path="rotate-worker-token")
    def rotate_worker_token(self, request: Request, pk: str | None = None) -> Response:
        """Admin: give the pool a new worker token and roll it out to its replicas (a pending ``pool.apply``
        Action; 409 if the pool is busy). The token itself is never returned: workers get it from the backend
        and routers from the routing table."""
        serializer = PoolWorkerTokenRotateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        act, created = pools.pool_worker_token_rotate(
            pool=self.get_object(), keep_previous=serializer.validated_data["keep_previous"],
            requested_by=request.user, idempotency_key=idempotency_key_from_request(request))
        return Response(ActionSerializer(act).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    """Observed replicas, refreshed by reconcile from the backends (read-only)."""

    serializer_class = ReplicaSerializer
    filterset_class = ReplicaFilterSet
    ordering_fields = ["name", "last_seen", "track"]
    ordering = ["pool_id", "track", "name"]

    def get_queryset(self):
        return fleet_selectors.replica_list()

    @extend_schema(
        parameters=[OpenApiParameter("tail", {"type": "integer", "minimum": 1, "maximum": MAX_LOG_TAIL_LINES},
                                     description="lines to return, 1..5000 (default 200)")],
        responses={200: OpenApiResponse(description='{"replica": name, "lines": [...]}'), 400: None, 404: None,
                   503: None},
    )
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, pk: str | None = None) -> Response:
        """``GET /api/v1/replicas/{id}/logs/?tail=N``: the replica's last log lines from its backend."""
        replica = self.get_object()
        tail = query_int(request.query_params, "tail", default=200, min_value=1, max_value=MAX_LOG_TAIL_LINES)
        try:
            lines = pools.replica_logs(replica=replica, tail=tail)
        except NotFound:
            return Response({"detail": f"the backend no longer has replica {replica.name!r}"},
                            status=status.HTTP_404_NOT_FOUND)
        except (BackendError, InvalidSpec) as exc:
            # The reason names the backend and what went wrong, never a byte of what a remote side sent.
            logger.warning("logs of replica %s: %s", replica.pk, exc)
            return Response({"detail": f"logs of {replica.name!r} are unavailable: {exc}"},
                            status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response({"replica": replica.name, "lines": lines})
