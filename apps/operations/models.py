"""``Action``: one requested change to the world, its status, lease, log and retry chain.

Status machine: ``pending`` -> ``running`` (claimed by a Celery task with a conditional update,
holding a lease it renews) -> ``succeeded`` | ``failed``; ``pending`` -> ``cancelled``. A running
Action whose lease expired (its worker died) goes back to ``pending`` (reconcile's takeover), and
a retryable backend failure does too while Celery retries it with backoff. A retry
is a new row whose ``retry_of`` points at the failed or cancelled one. At most one pending or
running Action per pool (a partial unique index: the per-pool lock of DESIGN.md).
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q


class Action(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE_STATUSES = (Status.PENDING, Status.RUNNING)
    FINISHED_STATUSES = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    kind = models.CharField(max_length=64, validators=[RegexValidator(r"^[a-z_]+\.[a-z_]+$")],
                            help_text="What to do, as <entity>.<verb>, e.g. pool.scale.")
    target_type = models.CharField(max_length=32, help_text="Entity kind of the target, e.g. pool, rollout.")
    target_id = models.CharField(max_length=64, help_text="Primary key of the target.")
    target_repr = models.CharField(max_length=200, blank=True, help_text="The target's name when requested.")
    pool = models.ForeignKey("fleet.Pool", null=True, blank=True, on_delete=models.SET_NULL, related_name="actions",
                             help_text="The pool this action locks, if any.")
    params = models.JSONField(default=dict, blank=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="ferry_actions")
    idempotency_key = models.CharField(max_length=255, null=True, blank=True, unique=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=64, blank=True,
                                   help_text="Who holds the running lease (a random id per claim).")
    attempts = models.PositiveIntegerField(default=0, help_text="Times the Action was claimed and started.")
    queued_at = models.DateTimeField(null=True, blank=True, help_text="Last time a task was sent for it.")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)
    retryable = models.BooleanField(null=True, blank=True,
                                    help_text="For failures: whether retrying as is may succeed.")
    log = models.JSONField(default=list, blank=True, help_text='[{"at": ISO-8601, "message": str}, ...]')
    retry_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="retries")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "created_at"]), models.Index(fields=["target_type", "target_id"])]
        constraints = [
            models.UniqueConstraint(
                fields=["pool"], condition=Q(status__in=["pending", "running"]),
                name="operations_action_one_active_per_pool",
                violation_error_message="This pool already has an action pending or running.",
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.kind} {self.target_type}:{self.target_id} ({self.status})"


class AutoscalerState(models.Model):
    """Per pool: the autoscaler's recent recommendations (for stabilization windows) and last decision."""

    pool = models.OneToOneField("fleet.Pool", on_delete=models.CASCADE, related_name="autoscaler_state")
    recommendations = models.JSONField(default=list, blank=True,
                                       help_text="[[unix seconds, replicas], ...] within the longest window.")
    last_value = models.FloatField(null=True, blank=True, help_text="The signal's value at the last evaluation.")
    last_replicas = models.PositiveIntegerField(null=True, blank=True, help_text="Decided total replicas.")
    last_reason = models.TextField(blank=True)
    base_replicas = models.PositiveIntegerField(null=True, blank=True,
                                                help_text="Total before the open schedule window, restored after.")
    evaluated_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"autoscaler of pool {self.pool_id}"
