"""Admin: alert thresholds editable per pool (and fleet defaults), alerts and silences read-only (operators
acknowledge and silence from the Alerts page or the API, which record the audit log), metric sources."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from apps.telemetry import services
from apps.telemetry.models import Alert, AlertRule, AlertSilence, MetricSourceConfig


@admin.register(AlertRule)
class AlertRuleAdmin(admin.ModelAdmin):
    list_display = ("name", "pool", "signal", "comparison", "threshold", "for_seconds", "severity", "enabled")
    list_editable = ("threshold", "for_seconds", "enabled")
    list_filter = ("severity", "enabled", "signal", ("pool", admin.EmptyFieldListFilter))
    search_fields = ("name", "description", "pool__name")
    autocomplete_fields = ("pool",)
    readonly_fields = ("created_at", "updated_at")

    def save_model(self, request: HttpRequest, obj: AlertRule, form: forms.ModelForm, change: bool) -> None:
        fields = {k: form.cleaned_data[k] for k in form.cleaned_data if k in {f.name for f in AlertRule._meta.fields}}
        if change:
            services.alert_rule_update(rule=AlertRule.objects.get(pk=obj.pk), **fields)
        else:
            obj.pk = services.alert_rule_create(**fields).pk

    def delete_model(self, request: HttpRequest, obj: AlertRule) -> None:
        services.alert_rule_delete(rule=obj)


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = ("rule", "pool", "state", "severity", "started_at", "ended_at", "value", "acknowledged_by")
    list_filter = ("state", "severity")
    search_fields = ("rule__name", "pool__name")
    date_hierarchy = "started_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Alert | None = None) -> bool:
        return False


@admin.register(AlertSilence)
class AlertSilenceAdmin(admin.ModelAdmin):
    list_display = ("rule", "pool", "starts_at", "ends_at", "created_by", "comment")
    search_fields = ("rule__name", "pool__name", "comment")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: AlertSilence | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: AlertSilence | None = None) -> bool:
        return False


@admin.register(MetricSourceConfig)
class MetricSourceConfigAdmin(admin.ModelAdmin):
    list_display = ("cluster", "kind", "prometheus_url", "dcgm_gpu_metrics")
    list_filter = ("kind",)
