"""Serializer for rollout plans; steps and gates are validated by :mod:`apps.rollouts.validators`."""

from rest_framework import serializers

from apps.fleet.models import Pool
from apps.rollouts.models import RolloutPlan


class RolloutPlanSerializer(serializers.ModelSerializer):
    pools = serializers.PrimaryKeyRelatedField(many=True, queryset=Pool.objects.all())
    created_by = serializers.CharField(source="created_by.username", read_only=True, default=None)

    class Meta:
        model = RolloutPlan
        fields = ["id", "name", "pools", "target_model_version", "strategy", "steps", "gates", "state",
                  "current_step_index", "next_step_at", "max_surge", "progress_deadline_s", "max_weight_skew",
                  "message", "created_by", "created_at", "updated_at"]
        read_only_fields = ["state", "current_step_index", "next_step_at", "message", "created_by", "created_at",
                            "updated_at"]
