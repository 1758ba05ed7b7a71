"""``/api/v1/rollouts/``: rollout plans; operators create, change (pending only) and delete them, and
drive them with ``POST /api/v1/rollouts/{id}/start|pause|resume|promote|abort|rollback/``.

A verb that the rollout's state does not allow answers 409 with a message naming the state and the
verbs that are allowed (:mod:`apps.rollouts.transitions`).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.roles import OPERATOR
from apps.rollouts import selectors, services
from apps.rollouts.api.filtersets import GateMeasurementFilterSet, RolloutPlanFilterSet
from apps.rollouts.api.serializers import (
    GateMeasurementSerializer,
    RolloutAbortSerializer,
    RolloutPlanSerializer,
)

VERB_SERVICES = {
    "start": services.rollout_start,
    "pause": services.rollout_pause,
    "resume": services.rollout_resume,
    "promote": services.rollout_promote,
    "abort": services.rollout_abort,
}


class RolloutPlanViewSet(viewsets.ModelViewSet):
    serializer_class = RolloutPlanSerializer
    filterset_class = RolloutPlanFilterSet
    ordering_fields = ["created_at", "name", "state"]
    ordering = ["-created_at", "-id"]
    write_role = OPERATOR

    def get_queryset(self):
        return selectors.rollout_list()

    def perform_create(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        plan = services.rollout_plan_create(created_by=self.request.user, **serializer.validated_data)
        serializer.instance = selectors.rollout_list().get(pk=plan.pk)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        plan = services.rollout_plan_update(plan=serializer.instance, **serializer.validated_data)
        serializer.instance = selectors.rollout_list().get(pk=plan.pk)

    def perform_destroy(self, instance) -> None:  # noqa: ANN001 - DRF signature
        services.rollout_plan_delete(plan=instance)

    def _verb(self, request: Request, verb: str) -> Response:
        plan = VERB_SERVICES[verb](plan=self.get_object(), requested_by=request.user)
        return Response(self.get_serializer(selectors.rollout_list().get(pk=plan.pk)).data)

    @extend_schema(request=None, responses=RolloutPlanSerializer, summary="Start a pending rollout")
    @action(detail=True, methods=["post"])
    def start(self, request: Request, pk: str | None = None) -> Response:
        return self._verb(request, "start")

    @extend_schema(request=None, responses=RolloutPlanSerializer, summary="Pause a progressing rollout")
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str | None = None) -> Response:
        return self._verb(request, "pause")

    @extend_schema(request=None, responses=RolloutPlanSerializer, summary="Resume a paused rollout")
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str | None = None) -> Response:
        return self._verb(request, "resume")

    @extend_schema(request=None, responses=RolloutPlanSerializer, summary="Skip the remaining steps and promote")
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, pk: str | None = None) -> Response:
        return self._verb(request, "promote")

    @extend_schema(request=RolloutAbortSerializer, responses=RolloutPlanSerializer,
                   summary="Abort: traffic back to stable; with force, remove the new-version tracks now")
    @action(detail=True, methods=["post"])
    def abort(self, request: Request, pk: str | None = None) -> Response:
        body = RolloutAbortSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        plan = services.rollout_abort(plan=self.get_object(), requested_by=request.user,
                                      force=body.validated_data["force"])
        return Response(self.get_serializer(selectors.rollout_list().get(pk=plan.pk)).data)

    @extend_schema(request=None, responses={201: RolloutPlanSerializer},
                   summary="After promotion: start a new rollout back to the previous version")
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, pk: str | None = None) -> Response:
        back = services.rollout_rollback(plan=self.get_object(), requested_by=request.user)
        data = self.get_serializer(selectors.rollout_list().get(pk=back.pk)).data
        return Response(data, status=status.HTTP_201_CREATED)


class GateMeasurementViewSet(viewsets.ReadOnlyModelViewSet):
    """``/api/v1/rollout-measurements/``: every gate evaluation (value, threshold, verdict)."""

    serializer_class = GateMeasurementSerializer
    filterset_class = GateMeasurementFilterSet
    ordering = ["-measured_at", "-id"]

    def get_queryset(self):
        return selectors.gate_measurement_list()
