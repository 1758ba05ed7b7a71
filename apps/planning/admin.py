"""Admin for planning: profiles and plans are read here (created by the command, the API and the page)."""

from django.contrib import admin

from apps.planning.models import PlanResult, PlanScenario, Profile


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    list_display = ["id", "model_version", "pool_kind", "hardware_label", "source", "pool", "created_at"]
    list_filter = ["source", "pool_kind"]
    readonly_fields = ["prefill_coefficients", "decode_coefficients", "created_at"]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001 - Django signature
        return False  # coefficients are fitted by the services: import with ferry_profile --import or the API


class PlanResultInline(admin.StackedInline):
    model = PlanResult
    extra = 0
    can_delete = False
    readonly_fields = [f.name for f in PlanResult._meta.fields]


@admin.register(PlanScenario)
class PlanScenarioAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "prefill_pool", "decode_pool", "link", "workload_source", "created_at"]
    inlines = [PlanResultInline]
