"""``/api/v1/rollouts/``: rollout plans; operators create, change (pending only) and delete them."""

from __future__ import annotations

from rest_framework import viewsets

from apps.accounts.roles import OPERATOR
from apps.rollouts import selectors, services
from apps.rollouts.api.filtersets import RolloutPlanFilterSet
from apps.rollouts.api.serializers import RolloutPlanSerializer


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
