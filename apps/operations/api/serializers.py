"""Serializers for Actions (read-only: Actions are created by services, never posted directly)."""

from rest_framework import serializers

from apps.operations.models import Action


class ActionSerializer(serializers.ModelSerializer):
    requested_by = serializers.CharField(source="requested_by.username", read_only=True, default=None)

    class Meta:
        model = Action
        fields = ["id", "kind", "target_type", "target_id", "target_repr", "pool", "params", "requested_by",
                  "idempotency_key", "status", "lease_expires_at", "attempts", "created_at", "started_at",
                  "finished_at", "error", "retryable", "log", "retry_of"]
        read_only_fields = fields
