"""Telemetry's stored state: the metric source per cluster, alert rules and alerts.

Signals themselves are not stored here: the poller keeps 15 minutes of them in Redis.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

from apps.telemetry.alerts import COMPARISONS, SEVERITIES
from apps.telemetry.signals import SIGNAL_NAMES


class MetricSourceConfig(models.Model):
    """How the poller reads a cluster's metrics. Without a row: direct scrape for local clusters;
    Prometheus at ``settings.FERRY_PROMETHEUS_URL`` (when set) for Kubernetes clusters."""

    class Kind(models.TextChoices):
        SCRAPE = "scrape", "Direct scrape of each replica's /metrics"
        PROMETHEUS = "prometheus", "Prometheus (PromQL)"

    cluster = models.OneToOneField("fleet.Cluster", on_delete=models.CASCADE, related_name="metric_source")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.SCRAPE)
    prometheus_url = models.URLField(blank=True, help_text="e.g. http://prometheus.monitoring:9090")
    dcgm_gpu_metrics = models.BooleanField(
        default=True, help_text="Kubernetes: read GPU utilization from NVIDIA's DCGM exporter (DCGM_FI_DEV_GPU_UTIL)."
    )

    class Meta:
        verbose_name = "metric source"

    def __str__(self) -> str:
        return f"{self.cluster_id}: {self.kind}"

    def clean(self) -> None:
        if self.kind == self.Kind.PROMETHEUS and not self.prometheus_url:
            raise ValidationError({"prometheus_url": "Give the Prometheus URL, or choose direct scrape."})


class AlertRule(models.Model):
    """``signal <comparison> threshold`` held for ``for_seconds`` fires an alert for a pool.

    ``pool`` empty: a fleet default, evaluated for every pool; a pool rule with the same
    ``name`` replaces the default for that pool (thresholds editable per pool in the admin).
    """

    name = models.SlugField(max_length=100, help_text="Rule name; a pool rule overrides the default of this name.")
    pool = models.ForeignKey("fleet.Pool", null=True, blank=True, on_delete=models.CASCADE, related_name="alert_rules",
                             help_text="Empty: fleet default for every pool.")
    signal = models.CharField(max_length=64, choices=[(n, n) for n in SIGNAL_NAMES])
    comparison = models.CharField(max_length=2, choices=[(c, c) for c in COMPARISONS])
    threshold = models.FloatField(help_text="In the signal's unit (ratios 0..1, seconds, counts).")
    for_seconds = models.PositiveIntegerField(default=0, help_text="How long the condition must hold to fire.")
    severity = models.CharField(max_length=16, choices=[(s, s) for s in SEVERITIES], default="warning")
    enabled = models.BooleanField(default=True)
    description = models.CharField(max_length=300, blank=True)
    webhook_url = models.URLField(blank=True, help_text="POST fired/resolved alerts here (optional).")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name", "pool_id"]
        constraints = [
            models.UniqueConstraint(fields=["name"], condition=Q(pool__isnull=True), name="telemetry_rule_unique_default",
                                    violation_error_message="A fleet default rule with this name exists."),
            models.UniqueConstraint(fields=["name", "pool"], name="telemetry_rule_unique_per_pool",
                                    violation_error_message="This pool already has a rule with this name."),
        ]

    def __str__(self) -> str:
        scope = f"pool {self.pool_id}" if self.pool_id else "fleet"
        return f"{self.name} ({scope}): {self.signal} {self.comparison} {self.threshold:g}"


class Alert(models.Model):
    """One firing episode of a rule for a pool: firing from ``started_at`` until ``ended_at``."""

    class State(models.TextChoices):
        FIRING = "firing"
        RESOLVED = "resolved"

    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="alerts")
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="alerts")
    state = models.CharField(max_length=16, choices=State.choices, default=State.FIRING)
    severity = models.CharField(max_length=16, help_text="The rule's severity when it fired.")
    started_at = models.DateTimeField(help_text="When the condition began to hold.")
    ended_at = models.DateTimeField(null=True, blank=True, help_text="When it stopped holding.")
    value = models.FloatField(null=True, blank=True, help_text="Signal value when the alert fired.")
    acknowledged_at = models.DateTimeField(null=True, blank=True, help_text="When an operator acknowledged it.")
    acknowledged_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                        related_name="+", help_text="Who acknowledged it.")

    class Meta:
        ordering = ["-started_at"]
        constraints = [
            models.UniqueConstraint(fields=["rule", "pool"], condition=Q(state="firing"),
                                    name="telemetry_alert_one_firing_per_rule_pool"),
        ]
        indexes = [models.Index(fields=["state", "pool"])]

    def __str__(self) -> str:
        return f"{self.rule.name} on pool {self.pool_id}: {self.state}"


class AlertSilence(models.Model):
    """Mutes the notifications of one rule on one pool from ``starts_at`` until ``ends_at``.

    Like an Alertmanager silence narrowed to (rule, pool): the alert still fires, resolves and shows on the
    pages (marked silenced); only the webhook stays quiet. Silencing an alert silences its rule on its
    pool, so the same rule firing again on that pool within the period is silenced too. Ending a silence
    early sets ``ends_at`` to that instant (rows are kept as history).
    """

    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="silences")
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="alert_silences")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    comment = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-ends_at", "-id"]
        indexes = [models.Index(fields=["rule", "pool", "ends_at"])]
        constraints = [
            models.CheckConstraint(condition=Q(ends_at__gte=models.F("starts_at")),
                                   name="telemetry_silence_ends_after_start",
                                   violation_error_message="A silence cannot end before it starts."),
        ]

    def __str__(self) -> str:
        return f"{self.rule.name} on pool {self.pool_id} silenced until {self.ends_at.isoformat()}"
