"""Serializers for Actions (read-only: Actions are created by services, never posted directly)."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.operations.models import Action
from apps.operations.services import action_requester


class ActionSerializer(serializers.ModelSerializer):
    requested_by = serializers.CharField(source="requested_by.username", read_only=True, default=None,
                                         help_text="The user who asked, or null (kept for compatibility: "
                                                   "see requester).")
    requester = serializers.SerializerMethodField(
        help_text="Who asked: a user's name, `autoscaler`, `rollout:<id>`, `reconcile`, or `system`. "
                  "Filter with ?requester=.")

    class Meta:
        model = Action
        fields = ["id", "kind", "target_type", "target_id", "target_repr", "pool", "params", "requested_by",
                  "requester", "idempotency_key", "status", "lease_expires_at", "attempts", "created_at",
                  "started_at", "finished_at", "error", "retryable", "log", "retry_of"]
        read_only_fields = fields

    @extend_schema_field(str)
    def get_requester(self, action: Action) -> str:
        # Listed Actions carry the SQL annotation (the filter's); a single one is computed the same way.
        annotated = getattr(action, "requester", None)
        return annotated if annotated is not None else action_requester(action)
