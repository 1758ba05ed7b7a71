"""Planning state: measured or imported pool ``Profile`` s, and ``PlanScenario`` / ``PlanResult`` pairs.

A profile holds the raw points it was fitted to (prefill seconds vs prompt tokens, decode step seconds vs batch
size) and the least-squares coefficients of :class:`inference_worker.planning.profiles.FittedProfile`. A scenario
is what the operator asked about (pools, link, workload); its result is what the planner
(:mod:`inference_worker.planning.planner`) recommended and predicted, and, once applied, the Actions it created.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from apps.fleet.models import Pool


class Profile(models.Model):
    class Source(models.TextChoices):
        MEASURED = "measured"
        IMPORTED = "imported"
        ROOFLINE = "roofline"

    model_version = models.ForeignKey("catalog.ModelVersion", on_delete=models.PROTECT, related_name="profiles")
    hardware_label = models.CharField(max_length=100, help_text="What the points were measured on, e.g. 'cpu-2core'.")
    pool_kind = models.CharField(max_length=16, choices=Pool.Role.choices,
                                 help_text="Role of the pool the profile describes: prefill, decode or colocated.")
    pool = models.ForeignKey("fleet.Pool", null=True, blank=True, on_delete=models.SET_NULL, related_name="profiles",
                             help_text="The pool it was measured on (measured profiles).")
    prefill_points = models.JSONField(help_text="[[prompt tokens, seconds], ...] as measured.")
    decode_points = models.JSONField(help_text="[[batch size, seconds per decode step], ...] as measured.")
    colocated_prefill_points = models.JSONField(
        default=list, blank=True,
        help_text="[[prompt tokens, seconds], ...] of prefills on a replica decoding one stream (a decode pool's "
                  "own prefill of short prompts); empty: not measured.")
    prefill_coefficients = models.JSONField(help_text="[a0, a1, a2]: t_prefill(N) = a0 + a1 N + a2 N^2 seconds.")
    decode_coefficients = models.JSONField(help_text="[b0, b1]: t_step(B) = b0 + b1 B seconds.")
    kv_capacity_bytes = models.BigIntegerField(null=True, blank=True,
                                               help_text="KV cache bytes per replica; empty = not known (no limit).")
    source = models.CharField(max_length=16, choices=Source.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.model_version} {self.pool_kind} on {self.hardware_label} ({self.source})"


class PlanScenario(models.Model):
    class WorkloadSource(models.TextChoices):
        GIVEN = "given"
        TELEMETRY = "telemetry"

    name = models.CharField(max_length=100, blank=True)
    prefill_pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="+",
                                     help_text="Remote prefill pool (long prompts prefill here).")
    decode_pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="+",
                                    help_text="Decode pool (also prefills prompts at or under the threshold).")
    link = models.ForeignKey("fleet.ClusterLink", on_delete=models.CASCADE, related_name="+",
                             help_text="The link the KV of remote prefills crosses.")
    workload_source = models.CharField(max_length=16, choices=WorkloadSource.choices, default=WorkloadSource.GIVEN)
    workload = models.JSONField(help_text="Length distributions, arrival rate and SLOs (see the API's schema).")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name or f"plan scenario #{self.pk}"


class PlanResult(models.Model):
    scenario = models.OneToOneField(PlanScenario, on_delete=models.CASCADE, related_name="result")
    prefill_profile = models.ForeignKey(Profile, on_delete=models.PROTECT, related_name="+")
    decode_profile = models.ForeignKey(Profile, on_delete=models.PROTECT, related_name="+")
    workload = models.JSONField(help_text="The workload the planner used (telemetry's when the source is telemetry).")
    prefill_replicas = models.PositiveIntegerField(help_text="Recommended replicas of the prefill pool.")
    decode_replicas = models.PositiveIntegerField(help_text="Recommended replicas of the decode pool.")
    fleet = models.JSONField(help_text="The planner's fleet: remote_prefill, local_prefill, decode, threshold.")
    threshold_tokens = models.IntegerField(null=True, blank=True,
                                           help_text="Remote prefill above this many prompt tokens; empty = never.")
    link_gbps = models.FloatField(help_text="Mean KV traffic on the link, Gbit/s.")
    link_share = models.FloatField(help_text="link_gbps over the link's bandwidth.")
    remote_share = models.FloatField(help_text="Share of requests prefilled remotely.")
    ttft_p50_s = models.FloatField()
    ttft_p90_s = models.FloatField()
    tpot_s = models.FloatField()
    attainment = models.FloatField(help_text="Predicted share of requests meeting both SLOs.")
    curve = models.JSONField(help_text="Predicted TTFT vs arrival rate: [{rate_per_s, ttft_p50_s, ttft_p90_s}, ...].")
    applied_at = models.DateTimeField(null=True, blank=True)
    applied = models.JSONField(default=list, blank=True,
                               help_text="Apply steps: [{step, pool, status, action, reason}, ...].")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"#{self.pk} of {self.scenario}"  # after the verbose name: "plan result #4 of peak"
