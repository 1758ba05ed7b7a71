"""``/api/v1/rollouts/``: rollout plans; operators create, change (pending only) and delete them, and
drive them with ``POST /api/v1/rollouts/{id}/start|pause|resume|promote|abort|rollback/``.

``POST /api/v1/rollouts/validate/`` checks a plan as create would, saving nothing (200 ``{"valid": true}``,
else create's 400/409); ``POST /api/v1/rollouts/preview/`` checks it the same way and answers what each step
will do (replicas per track per pool, weight; :func:`apps.rollouts.preview.rollout_preview`).

A verb that the rollout's state does not allow answers 409 with a message naming the state and the
verbs that are allowed (:mod:`apps.rollouts.transitions`). The verbs take no body (``abort``: optional ``force``); a
field they do not take answers 400 naming it (:func:`apps.core.serializers.empty_body_check`), the verb not done.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.roles import OPERATOR
from apps.core.exceptions import Conflict
from apps.core.serializers import empty_body_check
from apps.rollouts import selectors, services
from apps.rollouts.api.filtersets import GateMeasurementFilterSet, RolloutPlanFilterSet
from apps.rollouts.api.serializers import (
    GateMeasurementSerializer,
    RolloutAbortSerializer,
    RolloutPlanSerializer,
    RolloutPreviewSerializer,
    RolloutValidSerializer,
)
from apps.rollouts.models import RolloutPlan
from apps.rollouts.preview import rollout_preview

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

    def _checked(self, request: Request) -> dict:
        """The body validated by create's serializer and service checks (raises 400/409 as create does)."""
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.rollout_plan_check(**serializer.validated_data)
        return serializer.validated_data

    @extend_schema(request=RolloutPlanSerializer, responses=RolloutValidSerializer,
                   summary="Dry run of create: every check, nothing saved")
    @action(detail=False, methods=["post"])
    def validate(self, request: Request) -> Response:
        self._checked(request)
        return Response({"valid": True})

    @extend_schema(request=RolloutPlanSerializer, responses=RolloutPreviewSerializer,
                   summary="What each step of a plan will do: replicas per track per pool and weight")
    @action(detail=False, methods=["post"])
    def preview(self, request: Request) -> Response:
        data = self._checked(request)
        fields = {k: data.get(k, RolloutPlan._meta.get_field(k).get_default())
                  for k in ("max_surge", "scale_down_delay_s")}
        try:
            preview = rollout_preview(pools=list(data["pools"]), strategy=data["strategy"],
                                      steps=data.get("steps", []), **fields)
        except ValueError as exc:
            raise Conflict(str(exc)) from exc
        return Response(preview)

    def _verb(self, request: Request, verb: str) -> Response:
        """Run ``verb`` on the rollout; 400 when the body carries a field, 404/409 as the service raises."""
        empty_body_check(request.data)
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
        empty_body_check(request.data)
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
