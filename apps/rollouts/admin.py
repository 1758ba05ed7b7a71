"""Admin for rollout plans; saves go through the rollouts services, pools are validated in the form.

The verbs (start, pause, resume, promote, abort, rollback) are admin actions calling the same
services as the API; a verb the state does not allow is reported per rollout, the others still run.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.core.errors import ConflictError
from apps.core.forms import form_errors
from apps.rollouts import selectors, services
from apps.rollouts.models import GateMeasurement, RolloutPlan


class RolloutPlanAdminForm(forms.ModelForm):
    class Meta:
        model = RolloutPlan
        fields = ["name", "pools", "target_model_version", "strategy", "steps", "gates", "max_surge",
                  "progress_deadline_s", "max_weight_skew", "scale_down_delay_s", "router", "worker_args"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.instance.pk is not None and self.instance.state != RolloutPlan.State.PENDING:
            raise ValidationError(f"This rollout is {self.instance.state}; only pending plans can be changed.")
        if data.get("pools") is not None and data.get("target_model_version") is not None:
            try:
                services.rollout_plan_validate_pools(pools=list(data["pools"]), target=data["target_model_version"],
                                                     plan_id=self.instance.pk)
            except ValidationError as exc:
                raise ValidationError(form_errors(exc, self.fields)) from exc
            except ConflictError as exc:
                raise ValidationError(str(exc)) from exc
        return data


@admin.register(RolloutPlan)
class RolloutPlanAdmin(admin.ModelAdmin):
    form = RolloutPlanAdminForm
    list_display = ("name", "strategy", "target_model_version", "state", "current_step_index", "next_step_at",
                    "created_by", "created_at")
    list_filter = ("state", "strategy", "target_model_version")
    search_fields = ("name", "target_model_version__name", "pools__name")
    readonly_fields = ("state", "phase", "current_step_index", "next_step_at", "step_started_at", "progress",
                       "stable_model_version", "rollback_of", "message", "created_at", "updated_at")
    filter_horizontal = ("pools",)
    actions = ["start", "pause", "resume", "promote", "abort", "rollback"]

    def _run(self, request: HttpRequest, queryset: QuerySet[RolloutPlan], service: Any, verb: str) -> None:
        done = 0
        for plan in queryset:
            try:
                service(plan=plan, requested_by=request.user)
                done += 1
            except (ConflictError, ValidationError) as exc:
                text = "; ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
                self.message_user(request, f"{plan}: {text}", messages.ERROR)
        if done:
            self.message_user(request, f"{verb}: {done} rollout(s).", messages.SUCCESS)

    @admin.action(description="Start selected rollouts")
    def start(self, request: HttpRequest, queryset: QuerySet[RolloutPlan]) -> None:
        self._run(request, queryset, services.rollout_start, "start")

    @admin.action(description="Pause selected rollouts")
    def pause(self, request: HttpRequest, queryset: QuerySet[RolloutPlan]) -> None:
        self._run(request, queryset, services.rollout_pause, "pause")

    @admin.action(description="Resume selected rollouts")
    def resume(self, request: HttpRequest, queryset: QuerySet[RolloutPlan]) -> None:
        self._run(request, queryset, services.rollout_resume, "resume")

    @admin.action(description="Promote selected rollouts (skip remaining steps)")
    def promote(self, request: HttpRequest, queryset: QuerySet[RolloutPlan]) -> None:
        self._run(request, queryset, services.rollout_promote, "promote")

    @admin.action(description="Abort selected rollouts (traffic back to stable)")
    def abort(self, request: HttpRequest, queryset: QuerySet[RolloutPlan]) -> None:
        self._run(request, queryset, services.rollout_abort, "abort")

    @admin.action(description="Roll back selected promoted rollouts (new rollout to the previous version)")
    def rollback(self, request: HttpRequest, queryset: QuerySet[RolloutPlan]) -> None:
        self._run(request, queryset, services.rollout_rollback, "rollback")

    def get_queryset(self, request: HttpRequest) -> QuerySet[RolloutPlan]:
        return selectors.rollout_list()

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # deletes go through rollout_plan_delete
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: RolloutPlan | None = None) -> bool:
        if obj is not None and obj.state in (RolloutPlan.State.PROGRESSING, RolloutPlan.State.PAUSED):
            return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: RolloutPlan, form: forms.ModelForm, change: bool) -> None:
        names = {f.name for f in RolloutPlan._meta.get_fields()}
        fields = {k: v for k, v in form.cleaned_data.items() if k in names}
        pools = fields.pop("pools")
        if change:
            services.rollout_plan_update(plan=RolloutPlan.objects.get(pk=obj.pk), pools=pools, **fields)
        else:
            obj.pk = services.rollout_plan_create(pools=pools, created_by=request.user, **fields).pk

    def save_related(self, request: HttpRequest, form: forms.ModelForm, formsets: Any, change: bool) -> None:
        """Pools were saved by the service in :meth:`save_model`."""

    def delete_model(self, request: HttpRequest, obj: RolloutPlan) -> None:
        services.rollout_plan_delete(plan=obj)


@admin.register(GateMeasurement)
class GateMeasurementAdmin(admin.ModelAdmin):
    """Gate evaluations, written by the rollout controller (read-only)."""

    list_display = ("rollout", "step_index", "gate_index", "pool", "track", "signal", "value", "comparison",
                    "threshold", "passed", "consecutive_failures", "measured_at")
    list_filter = ("passed", "signal")
    search_fields = ("rollout__name", "detail")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: GateMeasurement | None = None) -> bool:
        return False
