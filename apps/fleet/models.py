"""The fleet: desired ``Cluster``, ``ClusterLink``, ``Pool``, ``PoolTrack``; observed ``Replica``; ``RoutingTable``.

A pool's desired replicas are kept per track (DESIGN.md, "Desired state"): a ``PoolTrack`` row per
track name (``stable``; during a rollout also ``canary`` or ``blue``/``green``) with its replica
count, model version, traffic weight (percent) and, for blue-green, whether it is the active one.
A child table rather than a JSON column, so each track's model version is a protected foreign key
(a version in use cannot be deleted) and the rollout controller can update one track row at a time.
Outside a rollout only ``stable`` exists and its model version equals ``Pool.model_version``.
"""

from __future__ import annotations

import math
import secrets

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q

from apps.fleet.validators import (
    DNS_LABEL,
    validate_cidr_list,
    validate_labels,
    validate_quantity,
    validate_router_url,
    validate_schedule_overrides,
    validate_time_zone,
    validate_tolerations,
)
from apps.fleet.worker_args import MAX_LENGTH as WORKER_ARGS_MAX_LENGTH
from apps.fleet.worker_args import InvalidWorkerArgs, parse_worker_args

MAX_REPLICAS = 10_000
dns_label_validator = RegexValidator(DNS_LABEL, "Use lowercase letters, digits and '-' (max 63, a DNS label).")


def validate_positive_finite(value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValidationError("Must be a finite number greater than 0.")


def validate_non_negative_finite(value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValidationError("Must be a finite number >= 0.")


def validate_replica_count(replicas: object) -> None:
    """A pool's or track's replica count: an integer (not a bool) in 0..``MAX_REPLICAS``; raises ValidationError."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= MAX_REPLICAS:
        raise ValidationError({"replicas": [f"replicas must be an integer in 0..{MAX_REPLICAS}."]})


def validate_worker_args(value: str) -> None:
    """A shell line of extra ``serve`` options, checked with the worker's own parser
    (:func:`apps.fleet.worker_args.parse_worker_args`); raises ValidationError with its message."""
    try:
        parse_worker_args(value)
    except InvalidWorkerArgs as exc:
        raise ValidationError(str(exc)) from exc


def validate_pool_engine(engine: str, role: str, cluster_kind: str | None) -> None:
    """A pool's engine against its role and cluster kind. Raises ValidationError naming the field.

    vLLM and SGLang pools run on Kubernetes only (the local agent starts Ferry workers) and only as colocated
    pools: the prefill -> decode KV hand-off is Ferry's own protocol.
    """
    if engine in ("", "ferry"):
        return
    if cluster_kind is not None and cluster_kind != "kubernetes":
        raise ValidationError({"engine": f"engine {engine!r} runs on Kubernetes clusters only; the local agent "
                                         "runs Ferry workers (engine 'ferry')."})
    if role not in ("", "colocated"):
        raise ValidationError({"engine": f"engine {engine!r} serves colocated pools only; prefill and decode pools "
                                         "hand KV over with Ferry's protocol (engine 'ferry')."})


class Cluster(models.Model):
    """A place workers run: a Kubernetes cluster (kubeconfig reference or in-cluster) or this host."""

    class Kind(models.TextChoices):
        KUBERNETES = "kubernetes"
        LOCAL = "local"

    class Status(models.TextChoices):
        UNKNOWN = "unknown"
        READY = "ready"
        UNREACHABLE = "unreachable"

    name = models.CharField(max_length=63, unique=True, validators=[dns_label_validator])
    kind = models.CharField(max_length=16, choices=Kind.choices)
    datacenter = models.CharField(max_length=100, blank=True, help_text="Datacenter or region label.")
    labels = models.JSONField(default=dict, blank=True, validators=[validate_labels])
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.UNKNOWN, editable=False)
    kubeconfig_path = models.CharField(max_length=500, blank=True, help_text="Kubeconfig file on the control plane.")
    kubeconfig_secret = models.CharField(
        max_length=253, blank=True, validators=[RegexValidator(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")],
        help_text="Name of a Kubernetes Secret (in Ferry's namespace) whose 'config' key holds the kubeconfig.",
    )
    context = models.CharField(max_length=253, blank=True, help_text="Kubeconfig context; empty = current.")
    namespace = models.CharField(max_length=63, blank=True, validators=[dns_label_validator])
    in_cluster = models.BooleanField(default=False, help_text="Use the service account of the pod Ferry runs in.")
    agent_url = models.URLField(blank=True, help_text="Local agent URL (kind local), e.g. http://127.0.0.1:9300.")
    gateway_httproute = models.CharField(
        max_length=253, blank=True, validators=[dns_label_validator],
        help_text="Gateway API traffic splitting (kind kubernetes): the HTTPRoute in the cluster's namespace whose "
                  "backendRefs weights the rollout controller writes between the per-track routers "
                  "(ferry-router-stable, ferry-router-canary). Empty: Ferry's router splits traffic alone.")
    production = models.BooleanField(
        default=True, help_text="Serves real traffic: worker options that inject faults (--fault-error-rate, "
                                "--fault-kv) are refused on its pools. The demo's clusters are not production.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.kind == self.Kind.KUBERNETES:
            refs = [f for f in ("kubeconfig_path", "kubeconfig_secret") if getattr(self, f)]
            if self.in_cluster and refs:
                errors[refs[0]] = "In-cluster clusters take no kubeconfig reference."
            if not self.in_cluster and len(refs) != 1:
                errors["kubeconfig_path"] = "Give exactly one of kubeconfig_path or kubeconfig_secret, or set in_cluster."
            if self.in_cluster and self.context:
                errors["context"] = "In-cluster clusters have no kubeconfig context."
            if not self.namespace:
                errors["namespace"] = "Kubernetes clusters need the namespace Ferry deploys into."
            if self.agent_url:
                errors["agent_url"] = "Only local clusters have an agent URL."
        elif self.kind == self.Kind.LOCAL:
            if not self.agent_url:
                errors["agent_url"] = "Local clusters need the agent URL."
            for f in ("kubeconfig_path", "kubeconfig_secret", "context", "namespace", "gateway_httproute"):
                if getattr(self, f):
                    errors[f] = "Only Kubernetes clusters take this field."
            if self.in_cluster:
                errors["in_cluster"] = "Only Kubernetes clusters can be in-cluster."
        if errors:
            raise ValidationError(errors)



class Router(models.Model):
    """A Ferry router registered by an admin: configuration, not free text.

    The control plane fetches router URLs (a rollout waiting for its routing-table version at ``/ready``,
    the telemetry poller scraping ``/metrics``) only from this registry, never from a URL an operator typed
    into a rollout. ``url`` is the router's base URL: ``http`` or ``https``, a host, an optional port and
    nothing else (no user info, path, query or fragment), checked by :func:`validate_router_url`.
    """

    name = models.CharField(max_length=63, unique=True, validators=[dns_label_validator])
    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="routers",
                                help_text="The cluster (datacenter) the router runs in.")
    url = models.CharField(max_length=300, validators=[validate_router_url],
                           help_text="Base URL, e.g. http://127.0.0.1:8080 (http or https; no path).")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def metrics_url(self) -> str:
        return f"{self.url.rstrip('/')}/metrics"


class ClusterLink(models.Model):
    """Network from ``source`` to ``destination``: bandwidth in Gbit/s and round-trip time in ms."""

    source = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="links_out")
    destination = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="links_in")
    bandwidth_gbps = models.FloatField(validators=[validate_positive_finite, MaxValueValidator(100_000)])
    rtt_ms = models.FloatField(validators=[validate_non_negative_finite, MaxValueValidator(100_000)])
    source_cidrs = models.JSONField(
        default=list, blank=True, validators=[validate_cidr_list],
        help_text="Addresses the source cluster's workers have as the destination sees them (pod or egress CIDRs, "
                  'e.g. ["10.8.0.0/16"]). On Kubernetes the destination\'s decode pools open their KV port, and its '
                  "prefill pools their HTTP port, to them.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["source__name", "destination__name"]
        constraints = [
            models.UniqueConstraint(fields=["source", "destination"], name="fleet_clusterlink_unique_pair",
                                    violation_error_message="A link between these clusters already exists."),
            models.CheckConstraint(condition=~Q(source=F("destination")), name="fleet_clusterlink_distinct",
                                   violation_error_message="A link needs two different clusters."),
            models.CheckConstraint(condition=Q(bandwidth_gbps__gt=0), name="fleet_clusterlink_bandwidth_positive"),
            models.CheckConstraint(condition=Q(rtt_ms__gte=0), name="fleet_clusterlink_rtt_non_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.source_id}->{self.destination_id}"

    def clean(self) -> None:
        if self.source_id is not None and self.source_id == self.destination_id:
            raise ValidationError({"destination": "A link needs two different clusters (source == destination)."})


WORKER_TOKEN_MAX_LENGTH = 64


def new_worker_token() -> str:
    """A fresh pool worker token: 32 random bytes as URL-safe base64 (43 characters, 256 bits of
    :func:`secrets.token_urlsafe`), printable ASCII without spaces as the workers and routers require."""
    return secrets.token_urlsafe(32)


class Pool(models.Model):
    """A set of identical workers in one cluster, with per-track desired replicas (``tracks``).

    ``worker_token`` is the pool's worker credential (issue 19): the bearer secret its workers require on every
    route but the probes (``inference_worker.server.worker_auth``), given to them by the backend (the process
    environment locally, a Secret on Kubernetes) and to routers in the routing table. It is stored in clear
    because the control plane must hand it out as it is (a hash could not be sent to workers); it is never
    editable, never in a serializer, form, page or log. ``worker_token_previous`` is the token before the last
    rotation, which workers and routers still accept while the replicas roll ("" when none).
    """

    class Role(models.TextChoices):
        PREFILL = "prefill"
        DECODE = "decode"
        COLOCATED = "colocated"

    class Engine(models.TextChoices):
        FERRY = "ferry"
        VLLM = "vllm"
        SGLANG = "sglang"

    class AutoscalingSignal(models.TextChoices):
        NUM_REQUESTS_WAITING = "num_requests_waiting"
        KV_CACHE_USAGE = "kv_cache_usage"
        TTFT_P99_SECONDS = "ttft_p99_seconds"
        TPOT_P99_SECONDS = "tpot_p99_seconds"
        ENGINE_BUSY_RATIO = "engine_busy_ratio"
        GPU_UTILIZATION = "gpu_utilization"

    name = models.CharField(max_length=63, validators=[dns_label_validator])
    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="pools")
    role = models.CharField(max_length=16, choices=Role.choices)
    model_version = models.ForeignKey(
        "catalog.ModelVersion", on_delete=models.PROTECT, related_name="pools",
        help_text="The stable model version (the stable track runs it).",
    )
    gpu_kind = models.CharField(max_length=100, blank=True, help_text="e.g. nvidia-h200; empty = CPU workers.")
    gpu_count = models.PositiveSmallIntegerField(default=0, validators=[MaxValueValidator(64)])
    cpu = models.CharField(max_length=32, blank=True, validators=[validate_quantity], help_text="e.g. 4 or 500m.")
    memory = models.CharField(max_length=32, blank=True, validators=[validate_quantity], help_text="e.g. 16Gi.")
    node_selector = models.JSONField(default=dict, blank=True, validators=[validate_labels])
    tolerations = models.JSONField(default=list, blank=True, validators=[validate_tolerations])
    autoscaling_enabled = models.BooleanField(default=False)
    min_replicas = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(MAX_REPLICAS)])
    max_replicas = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(MAX_REPLICAS)])
    autoscaling_signal = models.CharField(max_length=32, choices=AutoscalingSignal.choices,
                                          default=AutoscalingSignal.NUM_REQUESTS_WAITING)
    autoscaling_target = models.FloatField(default=4.0, validators=[validate_positive_finite],
                                           help_text="Target per replica, in the signal's unit.")
    scale_up_stabilization_s = models.PositiveIntegerField(
        default=0, validators=[MaxValueValidator(3600)],
        help_text="Scale up to the lowest recommendation of this many seconds (Kubernetes HPA's window).")
    scale_down_stabilization_s = models.PositiveIntegerField(
        default=300, validators=[MaxValueValidator(3600)],
        help_text="Scale down to the highest recommendation of this many seconds (HPA default 300).")
    schedule_overrides = models.JSONField(default=list, blank=True, validators=[validate_schedule_overrides])
    schedule_time_zone = models.CharField(max_length=64, default="UTC", validators=[validate_time_zone])
    drain_timeout_s = models.PositiveIntegerField(default=300, validators=[MaxValueValidator(86_400)])
    engine = models.CharField(
        max_length=16, choices=Engine.choices, default=Engine.FERRY,
        help_text="The server its replicas run (inference_worker.engine_kinds). vllm and sglang: Kubernetes "
                  "clusters and colocated pools only (the local agent runs Ferry workers; PD hand-off is Ferry's).")
    worker_token = models.CharField(max_length=WORKER_TOKEN_MAX_LENGTH, default=new_worker_token, editable=False,
                                    help_text="Bearer secret the pool's workers require (never shown).")
    worker_token_previous = models.CharField(max_length=WORKER_TOKEN_MAX_LENGTH, blank=True, default="",
                                             editable=False,
                                             help_text="The token before the last rotation, still accepted.")
    remote_threshold_min_tokens = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Lower bound of the effective remote-prefill threshold (uncached prompt tokens): prompts with at "
                  "most this many uncached tokens always prefill locally. Empty: no bound. The router applies a "
                  "decode or colocated pool's bounds.")
    remote_threshold_max_tokens = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Upper bound of the effective remote-prefill threshold (uncached prompt tokens): longer prompts "
                  "always prefill remotely when a prefill replica exists. Empty: no bound.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["cluster__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["cluster", "name"], name="fleet_pool_unique_name_per_cluster",
                                    violation_error_message="This cluster already has a pool with this name."),
            models.CheckConstraint(condition=Q(min_replicas__lte=F("max_replicas")), name="fleet_pool_min_le_max",
                                   violation_error_message="min_replicas must be <= max_replicas."),
            models.CheckConstraint(
                condition=Q(remote_threshold_min_tokens__isnull=True) | Q(remote_threshold_max_tokens__isnull=True)
                | Q(remote_threshold_min_tokens__lte=F("remote_threshold_max_tokens")),
                name="fleet_pool_remote_threshold_min_le_max",
                violation_error_message="remote_threshold_min_tokens must be <= remote_threshold_max_tokens."),
        ]

    def __str__(self) -> str:
        return f"{self.cluster.name}/{self.name}" if self.cluster_id else self.name

    def clean(self) -> None:
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValidationError({"min_replicas": "min_replicas must be <= max_replicas."})
        low, high = self.remote_threshold_min_tokens, self.remote_threshold_max_tokens
        if low is not None and high is not None and low > high:
            raise ValidationError({"remote_threshold_min_tokens": f"remote_threshold_min_tokens ({low}) must be <= "
                                                                  f"remote_threshold_max_tokens ({high})."})
        if self.gpu_count and not self.gpu_kind:
            raise ValidationError({"gpu_kind": "Say which GPU kind when gpu_count > 0."})
        validate_pool_engine(self.engine, self.role, self.cluster.kind if self.cluster_id else None)

    @property
    def replicas(self) -> int:
        """Total desired replicas over all tracks (uses prefetched ``tracks`` when present)."""
        return sum(track.replicas for track in self.tracks.all())


class PoolTrack(models.Model):
    """One track of a pool: desired replicas, model version, traffic weight (percent), active flag."""

    class Name(models.TextChoices):
        STABLE = "stable"
        CANARY = "canary"
        BLUE = "blue"
        GREEN = "green"

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="tracks")
    name = models.CharField(max_length=16, choices=Name.choices)
    model_version = models.ForeignKey("catalog.ModelVersion", on_delete=models.PROTECT, related_name="pool_tracks")
    replicas = models.PositiveIntegerField(validators=[MaxValueValidator(MAX_REPLICAS)])
    weight = models.PositiveSmallIntegerField(default=100, validators=[MinValueValidator(0), MaxValueValidator(100)],
                                              help_text="Share of the pool's traffic, percent.")
    active = models.BooleanField(default=True, help_text="Blue-green: this track serves traffic.")
    extra_args = models.CharField(
        max_length=WORKER_ARGS_MAX_LENGTH, blank=True, default="", validators=[validate_worker_args],
        help_text="Extra 'serve' options of this track's workers (a shell line, after FERRY_WORKER_EXTRA_ARGS), "
                  "e.g. --max-num-seqs 8. Set from the rollout plan's worker_args for a canary or preview track.",
    )

    class Meta:
        ordering = ["pool_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "name"], name="fleet_pooltrack_unique_name"),
            models.CheckConstraint(condition=Q(weight__lte=100), name="fleet_pooltrack_weight_le_100"),
        ]

    def __str__(self) -> str:
        return f"{self.pool_id}:{self.name}"


class Replica(models.Model):
    """An observed worker replica (read from the backend by reconcile; never the source of intent)."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="observed_replicas")
    track = models.CharField(max_length=16)
    name = models.CharField(max_length=253, help_text="Backend id: pod name or local agent process name.")
    endpoint = models.CharField(max_length=300, blank=True, help_text="http://host:port of the worker.")
    ready = models.BooleanField(default=False)
    alive = models.BooleanField(default=True)
    version = models.CharField(max_length=100, blank=True, help_text="Model version label of the replica.")
    restart_count = models.PositiveIntegerField(default=0)
    exit_code = models.IntegerField(null=True, blank=True)
    exited_at = models.DateTimeField(null=True, blank=True, help_text="When it last died, if the backend knows.")
    message = models.TextField(blank=True, help_text="Its last termination message, e.g. why its model failed to load.")
    first_seen = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField()

    class Meta:
        ordering = ["pool_id", "track", "name"]
        constraints = [models.UniqueConstraint(fields=["pool", "name"], name="fleet_replica_unique_name")]

    def __str__(self) -> str:
        return self.name


class RoutingTable(models.Model):
    """The published routing table (one row): its version increases only when ``content`` changes."""

    version = models.PositiveBigIntegerField(default=0)
    digest = models.CharField(max_length=64, help_text="sha256 of the canonical JSON of content.")
    content = models.JSONField(help_text="The table without its version (inference_worker.router.table shape).")
    published_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"routing table v{self.version}"
