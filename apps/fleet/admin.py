"""Admin for clusters, links and pools; saves go through the fleet services, scaling creates Actions."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.core.errors import ConflictError
from apps.fleet import selectors, services
from apps.fleet.models import MAX_REPLICAS, Cluster, ClusterLink, Pool, PoolTrack, Replica, RoutingTable
from apps.operations.models import Action
from apps.rollouts.selectors import rollout_active_for_pool


def _model_fields(form: forms.ModelForm, only_changed: bool = False) -> dict[str, Any]:
    """The form's cleaned values of model fields (only the changed ones when ``only_changed``)."""
    names = {f.name for f in form._meta.model._meta.get_fields()}
    keys = set(form.changed_data) if only_changed else set(form.cleaned_data)
    return {k: v for k, v in form.cleaned_data.items() if k in names and k in keys}


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "datacenter", "status", "namespace", "agent_url", "created_at")
    list_filter = ("kind", "status", "datacenter")
    search_fields = ("name", "datacenter")
    readonly_fields = ("status", "created_at", "updated_at")
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}  # agents listen on plain HTTP loopback

    def save_model(self, request: HttpRequest, obj: Cluster, form: forms.ModelForm, change: bool) -> None:
        if change:
            services.cluster_update(cluster=Cluster.objects.get(pk=obj.pk), **_model_fields(form, True))
        else:
            obj.pk = services.cluster_create(**_model_fields(form)).pk

    def delete_model(self, request: HttpRequest, obj: Cluster) -> None:
        services.cluster_delete(cluster=obj)


@admin.register(ClusterLink)
class ClusterLinkAdmin(admin.ModelAdmin):
    list_display = ("__str__", "source", "destination", "bandwidth_gbps", "rtt_ms")
    list_filter = ("source", "destination")
    search_fields = ("source__name", "destination__name")
    list_select_related = ("source", "destination")

    def save_model(self, request: HttpRequest, obj: ClusterLink, form: forms.ModelForm, change: bool) -> None:
        if change:
            services.cluster_link_update(link=ClusterLink.objects.get(pk=obj.pk), **_model_fields(form, True))
        else:
            obj.pk = services.cluster_link_create(**_model_fields(form)).pk

    def delete_model(self, request: HttpRequest, obj: ClusterLink) -> None:
        services.cluster_link_delete(link=obj)


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
                  "drain_timeout_s"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.instance.pk is None and data.get("replicas") is None:
            self.add_error("replicas", "Required when creating a pool.")
        if self.instance.pk is not None:
            moving = [f for f in ("model_version", "cluster") if f in self.changed_data]
            if moving and rollout_active_for_pool(pool=self.instance) is not None:
                raise ValidationError(f"The pool is in an active rollout; cannot change {', '.join(moving)}.")
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
        return selectors.pool_list()

    @admin.display(description="replicas")
    def total_replicas(self, obj: Pool) -> int:
        return obj.replicas

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # deletes go through pool_delete (busy pools are refused)
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: Pool | None = None) -> bool:
        if obj is not None and (obj.actions.filter(status__in=Action.ACTIVE_STATUSES).exists()
                                or rollout_active_for_pool(pool=obj) is not None):
            return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: Pool, form: forms.ModelForm, change: bool) -> None:
        if change:
            services.pool_update(pool=Pool.objects.get(pk=obj.pk), **_model_fields(form, True))
        else:
            fields = _model_fields(form)
            obj.pk = services.pool_create(replicas=form.cleaned_data["replicas"], **fields).pk

    def delete_model(self, request: HttpRequest, obj: Pool) -> None:
        services.pool_delete(pool=obj)

    def _scale(self, request: HttpRequest, queryset: QuerySet[Pool], delta: int) -> None:
        for pool in queryset:
            try:
                act, _ = services.pool_scale(pool=pool, replicas=max(0, pool.replicas + delta),
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


class _ReadOnlyAdmin(admin.ModelAdmin):
    """Observed state: written by reconcile, never by hand."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(_ReadOnlyAdmin):
    list_display = ("name", "pool", "track", "endpoint", "ready", "alive", "version", "restart_count", "last_seen")
    list_filter = ("ready", "alive", "track", "pool__cluster")
    search_fields = ("name", "endpoint", "pool__name")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Replica]:
        return selectors.replica_list()


@admin.register(RoutingTable)
class RoutingTableAdmin(_ReadOnlyAdmin):
    list_display = ("version", "digest", "published_at")
