"""Serializers for profiles and plans. Points and workloads are validated again by the services."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.serializers import StrictFieldsMixin, StrictFloatField, StrictPrimaryKeyRelatedField
from apps.fleet.models import ClusterLink, Pool
from apps.planning import profiling, selectors
from apps.planning.models import PlanResult, PlanScenario, Profile


class ProfileSerializer(serializers.ModelSerializer):
    model_version_label = serializers.CharField(source="model_version.__str__", read_only=True,
                                                help_text="The model version as name:version.")

    class Meta:
        model = Profile
        fields = ["id", "model_version", "model_version_label", "hardware_label", "pool_kind", "pool", "source", "prefill_points",
                  "decode_points", "colocated_prefill_points", "prefill_coefficients", "decode_coefficients", "kv_capacity_bytes", "created_at"]
        read_only_fields = fields


class ProfileImportSerializer(StrictFieldsMixin, serializers.Serializer):
    """``POST /api/v1/profiles/``: a profile file's content for a pool (its model version and role)."""

    pool = StrictPrimaryKeyRelatedField(queryset=Pool.objects.select_related("model_version"))
    profile = serializers.JSONField(help_text='The file: {"hardware_label", "source" (imported|roofline), '
                                              '"prefill_points": [[tokens, s]], "decode_points": [[batch, s]], '
                                              '"colocated_prefill_points" (optional) [[tokens, s]], '
                                              '"kv_capacity_bytes"}.')


class ProfileMeasureSerializer(StrictFieldsMixin, serializers.Serializer):
    """``POST /api/v1/profiles/measure/``: a bounded sweep of a pool's ready replica (a ``pool.profile`` Action)."""

    pool = StrictPrimaryKeyRelatedField(queryset=Pool.objects.all())
    hardware_label = serializers.CharField(max_length=100)
    lengths = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=1_000_000),
                                    min_length=3, max_length=profiling.MAX_LENGTHS, required=False)
    batch_sizes = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=256),
                                        min_length=2, max_length=profiling.MAX_BATCH_SIZES, required=False)
    max_new_tokens = serializers.IntegerField(min_value=4, max_value=64, default=profiling.DEFAULT_MAX_NEW_TOKENS)


GIVEN_FIELDS = ("prompt_median", "prompt_cap", "output_median", "rate_per_s")
"""The workload fields a plan needs unless telemetry gives them."""
REQUIRED_GIVEN = "This field is required unless workload_source is telemetry."


class WorkloadSerializer(StrictFieldsMixin, serializers.Serializer):
    """Lengths in tokens, the arrival rate (Poisson, req/s) and the objectives. With the telemetry source the
    lengths and rate are read from telemetry and may be left out."""

    prompt_median = serializers.IntegerField(min_value=1, max_value=1_000_000, required=False)
    prompt_p90 = serializers.IntegerField(min_value=1, max_value=1_000_000, required=False, allow_null=True,
                                          default=None)
    prompt_cap = serializers.IntegerField(min_value=1, max_value=1_000_000, required=False)
    output_median = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    rate_per_s = StrictFloatField(min_value=1e-6, max_value=1e6, required=False)
    ttft_slo_s = StrictFloatField(min_value=1e-3, max_value=3600)
    tpot_slo_s = StrictFloatField(min_value=1e-4, max_value=60)
    attainment = StrictFloatField(min_value=0.01, max_value=0.999, default=0.9)
    max_link_share = StrictFloatField(min_value=0.01, max_value=1.0, default=1.0)
    cached_prefix_mean = StrictFloatField(
        min_value=0.0, max_value=1_000_000, default=0.0,
        help_text="Mean prompt tokens per request found in a prefix cache (a conversation's earlier turns): not "
                  "computed but attended to; the prompt lengths are then the computed tokens.")

    def to_internal_value(self, data: Any) -> dict:  # noqa: ANN401 - DRF's signature
        """The fields' errors and the fields the ``given`` source requires, in one answer."""
        errors, value = {}, None
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if not isinstance(exc.detail, Mapping):
                raise
            errors = dict(exc.detail)
        if isinstance(data, Mapping) and not self._telemetry:
            errors.update({f: [REQUIRED_GIVEN] for f in GIVEN_FIELDS if f not in data and f not in errors})
            if errors:  # the lengths' order too, from those that parsed
                for field, message in self._order_errors(self._parsed(data, ("prompt_median", "prompt_p90",
                                                                             "prompt_cap"))).items():
                    errors.setdefault(field, [message])
        if errors:
            raise serializers.ValidationError(errors)
        return value

    def _parsed(self, data: Mapping, names: tuple[str, ...]) -> dict:
        parsed = {}
        for name in names:
            if data.get(name) is not None:
                try:
                    parsed[name] = self.fields[name].run_validation(data[name])
                except serializers.ValidationError:
                    pass
        return parsed

    @staticmethod
    def _order_errors(values: Mapping) -> dict[str, str]:
        """``prompt_median <= prompt_p90 <= prompt_cap`` on the values given (a missing one is not checked)."""
        median, p90, cap = (values.get(k) for k in ("prompt_median", "prompt_p90", "prompt_cap"))
        errors = {}
        if p90 is not None and median is not None and p90 < median:
            errors["prompt_p90"] = "must be at least prompt_median"
        if cap is not None and cap < max(median or 0, p90 or 0):
            errors["prompt_cap"] = "must be at least prompt_median and prompt_p90"
        return errors

    @property
    def _telemetry(self) -> bool:
        return self.context.get("workload_source") == PlanScenario.WorkloadSource.TELEMETRY

    def validate(self, attrs: dict) -> dict:
        if not self._telemetry:
            order = self._order_errors(attrs)
            if order:
                raise serializers.ValidationError({field: [message] for field, message in order.items()})
        else:
            given = sorted(set(self.initial_data) & {*GIVEN_FIELDS, "prompt_p90", "cached_prefix_mean"})
            if given:
                raise serializers.ValidationError({f: ["telemetry gives this with workload_source telemetry; leave it "
                                                       "out, or use workload_source given"] for f in given})
            attrs = {k: attrs[k] for k in ("ttft_slo_s", "tpot_slo_s", "attainment", "max_link_share")}
        return attrs


@extend_schema_field(WorkloadSerializer)
class WorkloadField(serializers.DictField):
    """The plan's workload: an object validated by :class:`WorkloadSerializer` (documented as it in the schema)."""


class PlanCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    """``POST /api/v1/plans/``: compute a plan for a prefill and a decode pool joined by a link."""

    name = serializers.CharField(max_length=100, required=False, default="", allow_blank=True)
    prefill_pool = StrictPrimaryKeyRelatedField(queryset=Pool.objects.select_related("model_version"))
    decode_pool = StrictPrimaryKeyRelatedField(queryset=Pool.objects.select_related("model_version"))
    link = StrictPrimaryKeyRelatedField(queryset=ClusterLink.objects.all())
    workload_source = serializers.ChoiceField(choices=PlanScenario.WorkloadSource.choices,
                                              default=PlanScenario.WorkloadSource.GIVEN)
    workload = WorkloadField(help_text="Lengths (tokens), rate_per_s and the objectives (s); with workload_source "
                                       "telemetry only the objectives.")
    max_replicas = serializers.IntegerField(min_value=2, max_value=256, default=16,
                                            help_text="The largest total (prefill + decode) the search tries.")

    def validate_workload(self, value: dict) -> dict:
        # A field validator, so the workload's errors come in the same answer as the other fields'.
        source = self.initial_data.get("workload_source") if isinstance(self.initial_data, Mapping) else None
        workload = WorkloadSerializer(data=value, context={"workload_source": source})
        if not workload.is_valid():
            raise serializers.ValidationError(workload.errors)
        return workload.validated_data

    def validate_decode_pool(self, value: Pool) -> Pool:
        # A field validator, so it answers with the other fields' errors (the prefill pool's raw id is compared).
        if isinstance(self.initial_data, Mapping) and str(self.initial_data.get("prefill_pool")) == str(value.pk):
            raise serializers.ValidationError("choose two different pools")
        return value


class PlanResultSerializer(serializers.ModelSerializer):
    name = serializers.CharField(source="scenario.name", read_only=True)
    prefill_pool = serializers.IntegerField(source="scenario.prefill_pool_id", read_only=True)
    decode_pool = serializers.IntegerField(source="scenario.decode_pool_id", read_only=True)
    link = serializers.IntegerField(source="scenario.link_id", read_only=True)
    workload_source = serializers.CharField(source="scenario.workload_source", read_only=True)
    notes = serializers.SerializerMethodField(help_text="What the planner's model leaves out for these pools "
                                                        "(apps.planning.selectors.plan_notes).")

    class Meta:
        model = PlanResult
        fields = ["id", "name", "prefill_pool", "decode_pool", "link", "workload_source", "workload",
                  "prefill_profile", "decode_profile", "prefill_replicas", "decode_replicas", "fleet",
                  "threshold_tokens", "link_gbps", "link_share", "remote_share", "ttft_p50_s", "ttft_p90_s", "tpot_s",
                  "attainment", "curve", "notes", "applied_at", "applied", "created_at"]
        read_only_fields = fields

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_notes(self, result: PlanResult) -> list[str]:
        return selectors.plan_notes(result=result)
