"""``/api/v1/profiles/`` and ``/api/v1/plans/``: viewers read, operators write.

- ``POST profiles/`` imports a profile file's content for a pool; ``POST profiles/measure/`` requests a profiling
  sweep of a pool (a ``pool.profile`` Action, 201; 409 if the pool is busy).
- ``POST plans/`` computes a plan (201; 400 naming the field when no fleet meets the objectives or an input is
  invalid); ``POST plans/{id}/apply/`` scales the pools and sets bounds through Actions (409 if a pool is busy);
  ``GET plans/{id}/measured/`` gives the prediction beside telemetry's measured TTFT of both pools;
  ``DELETE plans/{id}/`` removes a plan (its scenario too), after which its profiles can be deleted.

Views call services and selectors only.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.roles import OPERATOR
from apps.core.idempotency import idempotency_key_from_request
from apps.core.serializers import empty_body_check
from apps.operations.api.serializers import ActionSerializer
from apps.planning import selectors, services
from apps.planning.api.filtersets import PlanResultFilterSet, ProfileFilterSet
from apps.planning.api.serializers import (
    PlanCreateSerializer,
    PlanResultSerializer,
    ProfileImportSerializer,
    ProfileMeasureSerializer,
    ProfileSerializer,
)


class ProfileViewSet(mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet):
    serializer_class = ProfileSerializer
    filterset_class = ProfileFilterSet
    ordering_fields = ["created_at"]
    ordering = ["-created_at", "-id"]
    write_role = OPERATOR

    def get_queryset(self):
        return selectors.profile_list()

    @extend_schema(request=ProfileImportSerializer, responses={201: ProfileSerializer})
    def create(self, request: Request, *args, **kwargs) -> Response:
        """Import a profile (a file's content) for a pool's model version and role; coefficients are fitted here."""
        serializer = ProfileImportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        profile = services.profile_import_data(pool=serializer.validated_data["pool"],
                                               data=serializer.validated_data["profile"])
        return Response(ProfileSerializer(profile).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ProfileMeasureSerializer, responses={200: ActionSerializer, 201: ActionSerializer})
    @action(detail=False, methods=["post"])
    def measure(self, request: Request) -> Response:
        """Request a profiling sweep of the pool's first ready replica (a pending ``pool.profile`` Action)."""
        serializer = ProfileMeasureSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        act, created = services.profile_measure(
            pool=data["pool"], hardware_label=data["hardware_label"], lengths=data.get("lengths"),
            batch_sizes=data.get("batch_sizes"), max_new_tokens=data["max_new_tokens"], requested_by=request.user,
            idempotency_key=idempotency_key_from_request(request))
        return Response(ActionSerializer(act).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class PlanViewSet(mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet):
    serializer_class = PlanResultSerializer
    filterset_class = PlanResultFilterSet
    ordering_fields = ["created_at"]
    ordering = ["-created_at", "-id"]
    write_role = OPERATOR

    def get_queryset(self):
        return selectors.plan_list()

    @extend_schema(request=PlanCreateSerializer, responses={201: PlanResultSerializer})
    def create(self, request: Request, *args, **kwargs) -> Response:
        """Compute a plan: replicas per pool, the remote-prefill threshold, link load, predicted TTFT/TPOT."""
        serializer = PlanCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        result = services.plan_create(**serializer.validated_data, requested_by=request.user)
        return Response(PlanResultSerializer(result).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        services.plan_delete(result=instance)

    @extend_schema(request=None, responses=PlanResultSerializer)
    @action(detail=True, methods=["post"])
    def apply(self, request: Request, pk: str | None = None) -> Response:
        """Scale each pool to its recommended replicas (``pool.scale`` Actions) and set the decode pool's
        threshold bounds; the result's ``applied`` lists each step with its Action or the reason it was skipped.
        400 when the body carries a field (apply takes none), 404 when the plan is gone, 409 when a pool is busy."""
        empty_body_check(request.data)
        result = self.get_object()
        try:
            services.plan_apply(result=result, requested_by=request.user)
        except services.PlanGone as exc:
            raise NotFound(str(exc)) from exc
        # plan_apply set the steps on ``result``: a delete right after the apply commits must not turn the
        # answer for a change that was made into an error (no read back).
        return Response(PlanResultSerializer(result).data)

    @extend_schema(request=None, responses=dict)
    @action(detail=True, methods=["get"])
    def measured(self, request: Request, pk: str | None = None) -> Response:
        """Predicted TTFT/TPOT beside both pools' measured values since the plan was applied
        (:func:`apps.planning.selectors.plan_measured`)."""
        return Response(selectors.plan_measured(result=self.get_object()))
