"""Serializers of the telemetry API."""

from __future__ import annotations

from rest_framework import serializers

from apps.telemetry.models import Alert, AlertRule


class AlertRuleSerializer(serializers.ModelSerializer):
    class Meta:
        model = AlertRule
        fields = ["id", "name", "pool", "signal", "comparison", "threshold", "for_seconds", "severity", "enabled",
                  "description", "webhook_url", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]
        validators = []  # uniqueness is checked by the model's full_clean in the service (clear messages)


class AlertSerializer(serializers.ModelSerializer):
    rule_name = serializers.CharField(source="rule.name", read_only=True)
    signal = serializers.CharField(source="rule.signal", read_only=True)

    class Meta:
        model = Alert
        fields = ["id", "rule", "rule_name", "signal", "pool", "state", "severity", "started_at", "ended_at", "value"]
        read_only_fields = fields
