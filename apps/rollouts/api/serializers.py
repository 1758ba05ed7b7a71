"""Serializers for rollout plans and gate measurements; steps and gates are validated by
:mod:`apps.rollouts.validators`."""

from rest_framework import serializers

from apps.core.serializers import StrictFieldsMixin, StrictPrimaryKeyRelatedField
from apps.fleet.models import Pool
from apps.rollouts.models import GateMeasurement, RolloutPlan
from apps.rollouts.transitions import allowed_verbs, state_label

ROUTER_URL_REFUSED = ("router_url is no longer accepted (the control plane fetches only registered routers): register "
                      "the router in /api/v1/routers/ (admin) and send its id as router.")


class RolloutPlanSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    """A rollout plan as read, and the body of its create, update (pending only), validate and preview.

    Raises (from ``is_valid(raise_exception=True)``):
        ValidationError: HTTP 400 naming each invalid, unknown or read-only field (``router_url`` says to register
            the router and send its id; ``state`` and the other progress fields say how they change).
    """

    how_to_change = {
        "router_url": ROUTER_URL_REFUSED,
        **{name: f"Read-only: {name} is the controller's; drive the rollout with POST /api/v1/rollouts/{{id}}/"
                 "start|pause|resume|promote|abort|rollback/."
           for name in ("state", "phase", "current_step_index", "next_step_at", "progress", "message")},
    }
    pools = StrictPrimaryKeyRelatedField(many=True, queryset=Pool.objects.all())
    created_by = serializers.CharField(source="created_by.username", read_only=True, default=None)
    allowed_verbs = serializers.SerializerMethodField(help_text="Verbs the current state allows.")
    state_label = serializers.SerializerMethodField(
        help_text="The state in words for pages: ``state``, except for a rollback rollout (``rollback_of`` set): "
                  "rollback pending, rolling back, rollback paused, rolled back (``promoted``), rollback aborted, "
                  "rollback failed.")
    router_url = serializers.CharField(
        source="router.url", read_only=True, default=None,
        help_text="Read only: the URL of ``router``. Writes are refused: register the router (admin, "
                  "/api/v1/routers/) and send its id as ``router``.")

    class Meta:
        model = RolloutPlan
        fields = ["id", "name", "pools", "target_model_version", "strategy", "steps", "gates", "state", "phase",
                  "current_step_index", "next_step_at", "max_surge", "progress_deadline_s", "max_weight_skew",
                  "scale_down_delay_s", "router", "router_url", "worker_args", "stable_model_version", "rollback_of", "progress",
                  "allowed_verbs", "state_label", "message", "created_by", "created_at", "updated_at"]
        read_only_fields = ["state", "phase", "current_step_index", "next_step_at", "stable_model_version",
                            "rollback_of", "progress", "message", "created_by", "created_at", "updated_at"]

    def get_allowed_verbs(self, plan: RolloutPlan) -> list[str]:
        return allowed_verbs(plan.state)

    def get_state_label(self, plan: RolloutPlan) -> str:
        return state_label(plan.state, is_rollback=plan.rollback_of_id is not None)


class GateMeasurementSerializer(serializers.ModelSerializer):
    class Meta:
        model = GateMeasurement
        fields = ["id", "rollout", "step_index", "gate_index", "pool", "track", "signal", "value", "threshold",
                  "comparison", "window_s", "passed", "consecutive_failures", "detail", "measured_at"]
        read_only_fields = fields


class RolloutAbortSerializer(StrictFieldsMixin, serializers.Serializer):
    """The optional body of ``POST /api/v1/rollouts/{id}/abort/``."""

    force = serializers.BooleanField(
        default=False,
        help_text="Remove the new-version tracks now, whatever their readiness, and end the cleanup (also "
                  "allowed on an aborted or failed rollout whose cleanup has not finished). Recorded as Actions.")


class RolloutValidSerializer(serializers.Serializer):
    """The answer of ``POST /api/v1/rollouts/validate/`` when every check passed."""

    valid = serializers.BooleanField()


class RolloutPreviewPoolSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    role = serializers.CharField()
    total = serializers.IntegerField(help_text="The pool total R (desired replicas at start).")
    stable_track = serializers.CharField()
    new_track = serializers.CharField()


class RolloutPreviewRowSerializer(serializers.Serializer):
    number = serializers.IntegerField(allow_null=True, help_text="Step number from 1; null: start or end.")
    text = serializers.CharField()
    weight = serializers.IntegerField(help_text="New-version traffic percent after this row.")
    replicas = serializers.DictField(child=serializers.DictField(child=serializers.IntegerField()),
                                     help_text="pool id -> track -> desired replicas once converged.")
    error = serializers.CharField(allow_null=True, help_text="Why the controller would refuse this step.")


class RolloutPreviewSerializer(serializers.Serializer):
    """The answer of ``POST /api/v1/rollouts/preview/`` (:func:`apps.rollouts.preview.rollout_preview`)."""

    strategy = serializers.CharField()
    pools = RolloutPreviewPoolSerializer(many=True)
    rows = RolloutPreviewRowSerializer(many=True)
    errors = serializers.ListField(child=serializers.CharField())
