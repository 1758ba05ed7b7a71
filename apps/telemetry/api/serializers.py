"""Serializers of the telemetry API."""

from __future__ import annotations

from rest_framework import serializers

from apps.core.serializers import StrictFieldsMixin
from apps.telemetry.models import Alert, AlertRule
from apps.telemetry.services import MAX_SILENCE_S, MIN_SILENCE_S


class AlertRuleSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    """An alert rule as read, and the body of its create and update (admin).

    Raises (from ``is_valid(raise_exception=True)``):
        ValidationError: HTTP 400 naming each invalid, unknown or read-only field.
    """

    class Meta:
        model = AlertRule
        fields = ["id", "name", "pool", "signal", "comparison", "threshold", "for_seconds", "severity", "enabled",
                  "description", "webhook_url", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]
        validators = []  # uniqueness is checked by the model's full_clean in the service (clear messages)


class AlertSerializer(serializers.ModelSerializer):
    rule_name = serializers.CharField(source="rule.name", read_only=True)
    signal = serializers.CharField(source="rule.signal", read_only=True)
    acknowledged_by = serializers.CharField(source="acknowledged_by.username", read_only=True, default=None)
    silenced_until = serializers.DateTimeField(read_only=True, default=None,
                                               help_text="End of the silence in effect (no notifications); null: none.")

    class Meta:
        model = Alert
        fields = ["id", "rule", "rule_name", "signal", "pool", "state", "severity", "started_at", "ended_at", "value",
                  "acknowledged_at", "acknowledged_by", "silenced_until"]
        read_only_fields = fields


class AlertSilenceRequestSerializer(StrictFieldsMixin, serializers.Serializer):
    """``POST /api/v1/alerts/{id}/silence/``: how long to silence the alert's rule on its pool."""

    duration_s = serializers.IntegerField(min_value=MIN_SILENCE_S, max_value=MAX_SILENCE_S,
                                          help_text="Seconds, 60 (one minute) .. 604800 (one week).")
    comment = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")
