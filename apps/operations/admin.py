"""Admin for Actions (read-only audit log with retry and cancel admin actions, the same services as the API),
the autoscaler's state, pools (create through fleet's services; update, delete and scale through operations'
``pools``, which record Actions) and client API keys (:mod:`apps.operations.client_keys`)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.accounts.models import ClientApiKey
from apps.core.errors import ConflictError
from apps.fleet import selectors as fleet_selectors
from apps.fleet import services as fleet_services
from apps.fleet.admin import model_fields
from apps.fleet.holds import pool_hold_reason
from apps.fleet.models import MAX_REPLICAS, Pool, PoolTrack
from apps.operations import client_keys, pools, selectors, services
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


class PoolTrackInline(admin.TabularInline):
    model = PoolTrack
    extra = 0
    fields = ("name", "model_version", "replicas", "weight", "active", "extra_args")
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class PoolAdminForm(forms.ModelForm):
    replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS, required=False,
                                  help_text="Initial replicas of the stable track (on create; then use the scale "
                                            "actions).")

    class Meta:
        model = Pool
        fields = ["name", "cluster", "role", "model_version", "gpu_kind", "gpu_count", "cpu", "memory",
                  "node_selector", "tolerations", "autoscaling_enabled", "min_replicas", "max_replicas",
                  "autoscaling_signal", "autoscaling_target", "schedule_overrides", "schedule_time_zone",
                  "drain_timeout_s", "remote_threshold_min_tokens", "remote_threshold_max_tokens"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.instance.pk is None and data.get("replicas") is None:
            self.add_error("replicas", "Required when creating a pool.")
        if self.instance.pk is not None:
            moving = [f for f in ("model_version", "cluster") if f in self.changed_data]
            held_by = pool_hold_reason(self.instance) if moving else None
            if held_by is not None:
                raise ValidationError(f"The pool is in {held_by}; cannot change {', '.join(moving)}.")
        return data


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    form = PoolAdminForm
    list_display = ("name", "cluster", "role", "model_version", "total_replicas", "autoscaling_enabled", "created_at")
    list_filter = ("role", "cluster", "autoscaling_enabled", "model_version")
    search_fields = ("name", "cluster__name", "model_version__name")
    readonly_fields = ("created_at", "updated_at")
    inlines = [PoolTrackInline]
    actions = ["scale_up_one", "scale_down_one"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Pool]:
        return fleet_selectors.pool_list()

    @admin.display(description="replicas")
    def total_replicas(self, obj: Pool) -> int:
        return obj.replicas

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # deletes go through pool_delete (busy pools are refused)
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: Pool | None = None) -> bool:
        if obj is not None and (obj.actions.filter(status__in=Action.ACTIVE_STATUSES).exists()
                                or pool_hold_reason(obj) is not None):
            return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: Pool, form: forms.ModelForm, change: bool) -> None:
        if change:
            pools.pool_update(pool=Pool.objects.get(pk=obj.pk), requested_by=request.user,
                              **model_fields(form, True))
        else:
            fields = model_fields(form)
            obj.pk = fleet_services.pool_create(replicas=form.cleaned_data["replicas"], **fields).pk

    def delete_model(self, request: HttpRequest, obj: Pool) -> None:
        pools.pool_delete(pool=obj, requested_by=request.user)

    def _scale(self, request: HttpRequest, queryset: QuerySet[Pool], delta: int) -> None:
        for pool in queryset:
            try:
                act, _ = pools.pool_scale(pool=pool, replicas=max(0, pool.replicas + delta),
                                          requested_by=request.user)
            except (ConflictError, ValidationError) as exc:
                self.message_user(request, f"{pool}: {'; '.join(getattr(exc, 'messages', [str(exc)]))}",
                                  messages.ERROR)
            else:
                self.message_user(request, f"{pool}: action #{act.pk} requests {act.params['replicas']} replicas.")

    @admin.action(description="Scale selected pools up by one replica (creates Actions)")
    def scale_up_one(self, request: HttpRequest, queryset: QuerySet[Pool]) -> None:
        self._scale(request, queryset, +1)

    @admin.action(description="Scale selected pools down by one replica (creates Actions)")
    def scale_down_one(self, request: HttpRequest, queryset: QuerySet[Pool]) -> None:
        self._scale(request, queryset, -1)


@admin.register(ClientApiKey)
class ClientApiKeyAdmin(admin.ModelAdmin):
    """Client API keys: add (the key is shown once, in the confirmation message), change limits, rotate and revoke
    through :mod:`apps.operations.client_keys` (audited; the routing table is republished). No delete: revoke."""

    list_display = ("name", "prefix", "active", "rate_per_s", "burst", "use_count", "last_used_at", "created_at",
                    "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "created_at", "rotated_at", "previous_valid_until", "revoked_at", "last_used_at",
                       "use_count")
    actions = ["rotate_keys", "revoke_keys"]

    @admin.display(boolean=True)
    def active(self, obj: ClientApiKey) -> bool:
        return obj.active

    def get_readonly_fields(self, request: HttpRequest, obj: ClientApiKey | None = None) -> tuple[str, ...]:
        return self.readonly_fields + (("name",) if obj is not None else ())

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: ClientApiKey, form: forms.ModelForm, change: bool) -> None:
        fields = {k: v for k, v in model_fields(form, only_changed=change).items() if k in client_keys.LIMIT_FIELDS}
        if change:
            client_keys.client_key_update(client_key=ClientApiKey.objects.get(pk=obj.pk), requested_by=request.user,
                                          **fields)
            return
        issued = client_keys.client_key_create(name=form.cleaned_data["name"], requested_by=request.user, **fields)
        obj.pk = issued.client_key.pk
        self.message_user(request, f"Client key {issued.client_key.name}: {issued.key} (shown once: store it now).",
                          messages.WARNING)

    def _each(self, request: HttpRequest, queryset: QuerySet[ClientApiKey], verb: str) -> None:
        for key in queryset:
            try:
                if verb == "rotate":
                    issued = client_keys.client_key_rotate(client_key=key, requested_by=request.user)
                    self.message_user(request, f"Client key {key.name}: new key {issued.key} (shown once; the old "
                                               "one is refused).", messages.WARNING)
                else:
                    client_keys.client_key_revoke(client_key=key, requested_by=request.user)
                    self.message_user(request, f"Client key {key.name} revoked.")
            except (ConflictError, ValidationError) as exc:
                self.message_user(request, f"{key.name}: {exc}", messages.ERROR)

    @admin.action(description="Rotate the selected keys (new secrets, shown once; old ones refused at once)")
    def rotate_keys(self, request: HttpRequest, queryset: QuerySet[ClientApiKey]) -> None:
        self._each(request, queryset, "rotate")

    @admin.action(description="Revoke the selected keys")
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ClientApiKey]) -> None:
        self._each(request, queryset, "revoke")
