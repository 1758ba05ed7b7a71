"""Admin for Actions: read-only audit log with retry and cancel admin actions (same services as the API)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.core.errors import ConflictError
from apps.operations import selectors, services
from apps.operations.models import Action, AutoscalerState


@admin.register(Action)
class ActionAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "target_repr", "status", "attempts", "retryable", "requested_by", "created_at",
                    "finished_at", "retry_of")
    list_filter = ("status", "kind", "target_type", "created_at")
    search_fields = ("target_repr", "target_id", "idempotency_key", "error", "requested_by__username")
    actions = ["retry_actions", "cancel_actions"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Action]:
        return selectors.action_list()

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def _apply(self, request: HttpRequest, queryset: QuerySet[Action], verb: str) -> None:
        for act in queryset:
            try:
                if verb == "retry":
                    new, _ = services.action_retry(action=act, requested_by=request.user)
                    self.message_user(request, f"#{act.pk}: retried as #{new.pk}.")
                else:
                    services.action_cancel(action=act, cancelled_by=request.user)
                    self.message_user(request, f"#{act.pk}: cancelled.")
            except ConflictError as exc:
                self.message_user(request, str(exc), messages.ERROR)

    @admin.action(description="Retry selected failed/cancelled actions", permissions=["view"])
    def retry_actions(self, request: HttpRequest, queryset: QuerySet[Action]) -> None:
        self._apply(request, queryset, "retry")

    @admin.action(description="Cancel selected pending actions", permissions=["view"])
    def cancel_actions(self, request: HttpRequest, queryset: QuerySet[Action]) -> None:
        self._apply(request, queryset, "cancel")


@admin.register(AutoscalerState)
class AutoscalerStateAdmin(admin.ModelAdmin):
    """The autoscaler's last decision per pool (read-only; policies are edited on the Pool)."""

    list_display = ("pool", "last_replicas", "last_value", "evaluated_at", "last_reason")
    search_fields = ("pool__name", "last_reason")

    def get_queryset(self, request: HttpRequest) -> QuerySet[AutoscalerState]:
        return AutoscalerState.objects.select_related("pool", "pool__cluster")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
