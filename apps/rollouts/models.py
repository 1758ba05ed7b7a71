"""``RolloutPlan``: move pools (a prefill and a decode pool together) from their stable version to a target;
``GateMeasurement``: one evaluation of one gate during a rollout.

The controller (:mod:`apps.rollouts.controller`) advances ``state``, ``current_step_index``,
``phase`` and ``next_step_at`` from the beat tick; ``progress`` holds its bookkeeping (pool totals,
the applied target, the routing-table version it waits for, analysis counters), read and written through
``RolloutPlan.typed_progress`` (:class:`apps.rollouts.progress.RolloutProgress`). The allowed
transitions are in :mod:`apps.rollouts.transitions`.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from apps.fleet.models import WORKER_ARGS_MAX_LENGTH, validate_worker_args
from apps.rollouts.progress import RolloutProgress
from apps.rollouts.validators import validate_gates, validate_steps


class RolloutPlan(models.Model):
    class Strategy(models.TextChoices):
        CANARY = "canary"
        BLUE_GREEN = "blue_green"

    class State(models.TextChoices):
        PENDING = "pending"
        PROGRESSING = "progressing"
        PAUSED = "paused"
        PROMOTED = "promoted"
        ABORTED = "aborted"
        FAILED = "failed"

    class Phase(models.TextChoices):
        """Where the controller is inside ``state``. Canary: ``steps`` -> ``finalizing``; blue-green:
        ``preview`` -> ``smoke`` -> ``steps`` -> ``switched``; after an abort or failure: ``reverting``;
        none before the start and after promotion."""

        NONE = "", "none"
        STEPS = "steps"
        FINALIZING = "finalizing"
        PREVIEW = "preview"
        SMOKE = "smoke"
        SWITCHED = "switched"
        REVERTING = "reverting"

    ACTIVE_STATES = (State.PENDING, State.PROGRESSING, State.PAUSED)

    name = models.CharField(max_length=100)
    pools = models.ManyToManyField("fleet.Pool", related_name="rollouts")
    target_model_version = models.ForeignKey("catalog.ModelVersion", on_delete=models.PROTECT, related_name="rollouts")
    strategy = models.CharField(max_length=16, choices=Strategy.choices)
    steps = models.JSONField(default=list, blank=True, validators=[validate_steps])
    gates = models.JSONField(default=list, blank=True, validators=[validate_gates])
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING, editable=False)
    current_step_index = models.PositiveIntegerField(default=0, editable=False)
    next_step_at = models.DateTimeField(null=True, blank=True, editable=False,
                                        help_text="When the reconcile tick should advance the plan.")
    max_surge = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(1000)],
                                            help_text="Extra replicas allowed above the pool total while moving.")
    progress_deadline_s = models.PositiveIntegerField(
        default=600, validators=[MinValueValidator(1), MaxValueValidator(86_400)],
        help_text="A step that makes no progress for this long fails the rollout.",
    )
    max_weight_skew = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(100)],
        help_text="Largest allowed gap, in percentage points, between the pools' canary weights while a "
                  "step is applied (0: prefill and decode move in lockstep).",
    )
    scale_down_delay_s = models.PositiveIntegerField(
        default=30, validators=[MaxValueValidator(86_400)],
        help_text="Blue-green: seconds the old (blue) track keeps its replicas after the switch, for an "
                  "instant switch-back by abort.",
    )
    router = models.ForeignKey(
        "fleet.Router", on_delete=models.PROTECT, null=True, blank=True, related_name="rollout_plans",
        help_text="The registered router fronting these pools (admin registry, /api/v1/routers/; in a cluster of "
                  "one of the pools); a step counts as applied once its /ready reports the new routing table "
                  "version. Empty: replica readiness only (replica ratio). Replaces router_url (free text).",
    )
    worker_args = models.CharField(
        max_length=WORKER_ARGS_MAX_LENGTH, blank=True, default="", validators=[validate_worker_args],
        help_text="Extra 'serve' options of the new version's workers (the canary or preview track), a shell line "
                  "checked with the worker's parser, e.g. --max-num-seqs 8. They stay with the track that serves "
                  "the new version after promotion. To rehearse a bad release: --fault-error-rate 0.5 (test only).",
    )
    phase = models.CharField(max_length=24, blank=True, editable=False, choices=Phase.choices, default=Phase.NONE,
                             help_text="Where the controller is inside the state (e.g. preview, finalizing).")
    step_started_at = models.DateTimeField(null=True, blank=True, editable=False,
                                           help_text="When the current step or phase began (progress deadline).")
    progress = models.JSONField(default=dict, blank=True, editable=False,
                                help_text="Controller bookkeeping: totals, target, awaited table version, gates.")
    stable_model_version = models.ForeignKey(
        "catalog.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+", editable=False,
        help_text="The version the pools ran when the rollout started (rollback goes back to it).",
    )
    rollback_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="rollbacks", editable=False)
    message = models.TextField(blank=True, editable=False, help_text="Why the plan is in its state.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="ferry_rollouts")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: object, **kwargs: object) -> None:
        if "_typed_progress" in self.__dict__:
            self.progress = self.__dict__["_typed_progress"].to_json()
        super().save(*args, **kwargs)

    @property
    def typed_progress(self) -> RolloutProgress:
        """``progress`` as a :class:`RolloutProgress`, parsed once per instance; :meth:`save` writes it back.

        Raises:
            ProgressError: the stored JSON has a bad value.
        """
        if "_typed_progress" not in self.__dict__:
            self.__dict__["_typed_progress"] = RolloutProgress.from_json(self.progress)
        return self.__dict__["_typed_progress"]

    @typed_progress.setter
    def typed_progress(self, value: RolloutProgress) -> None:
        self.__dict__["_typed_progress"] = value

    def refresh_from_db(self, *args: object, **kwargs: object) -> None:
        self.__dict__.pop("_typed_progress", None)
        super().refresh_from_db(*args, **kwargs)

    def clean(self) -> None:
        if self.strategy == self.Strategy.CANARY and not self.steps:
            raise ValidationError({"steps": "A canary rollout needs at least one step (e.g. {\"set_weight\": 10})."})
        if self.strategy == self.Strategy.BLUE_GREEN and isinstance(self.steps, list) and any(
            isinstance(s, dict) and "set_weight" in s for s in self.steps
        ):
            raise ValidationError({"steps": "Blue-green switches all traffic at once; use pause/analysis steps only."})


class GateMeasurement(models.Model):
    """One evaluation of one gate on one pool's track: the measured value (None = no data) and verdict."""

    rollout = models.ForeignKey(RolloutPlan, on_delete=models.CASCADE, related_name="measurements")
    step_index = models.IntegerField(help_text="Index of the analysis step (-1: blue-green pre-switch gates).")
    gate_index = models.PositiveIntegerField()
    pool = models.ForeignKey("fleet.Pool", null=True, on_delete=models.SET_NULL, related_name="+")
    track = models.CharField(max_length=16)
    signal = models.CharField(max_length=64)
    value = models.FloatField(null=True, blank=True, help_text="Measured value; empty = no data (fails).")
    threshold = models.FloatField()
    comparison = models.CharField(max_length=2)
    window_s = models.PositiveIntegerField()
    passed = models.BooleanField()
    consecutive_failures = models.PositiveIntegerField(default=0)
    detail = models.CharField(max_length=300, blank=True)
    measured_at = models.DateTimeField()

    class Meta:
        ordering = ["rollout_id", "measured_at", "id"]

    def __str__(self) -> str:
        return f"{self.signal}={self.value} ({'pass' if self.passed else 'fail'})"
