"""The orchestrator backend interface: plain frozen dataclasses in and out, typed errors.

Every change Ferry makes to the world goes through one ``OrchestratorBackend`` chosen by the
cluster's kind (``kubernetes`` or ``local``). The verbs are DESIGN's ("Desired state"): apply a
pool track, scale a track, set traffic weights, switch the active track (blue-green), delete a
track, restart a replica, observe, read logs. Nothing here imports Django: callers (Celery tasks,
reconcile) turn their model rows into these dataclasses, so this package depends on nobody.

Errors are typed so a caller decides retries by type: ``BackendUnavailable`` is retryable (the
backend could not be reached or answered 5xx after bounded backoff), ``Conflict`` means a
concurrent writer won every bounded retry, ``NotFound`` and ``InvalidSpec`` are permanent.
"""

from __future__ import annotations

import abc
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from inference_worker.engine_kinds import ENGINE_KINDS, FERRY

ROLES = ("prefill", "decode", "colocated")
TRACKS = ("stable", "canary", "blue", "green")

# set_traffic_weights / switch_active results: who actually moves the traffic.
ROUTING_TABLE = "routing_table"  # Ferry's router owns it: the caller must publish the routing table
APPLIED = "applied"  # the backend changed its own objects (e.g. a Service selector) as well

# Label keys shared by every backend (Kubernetes labels, local agent process labels).
LABEL_POOL = "ferry.io/pool"
LABEL_POOL_ID = "ferry.io/pool-id"
LABEL_ROLE = "ferry.io/role"
LABEL_TRACK = "ferry.io/track"
LABEL_MODEL_VERSION = "ferry.io/model-version"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_PART_OF = "app.kubernetes.io/part-of"

# The worker's environment variables of its pool's credential (inference_worker.server.worker_auth; not imported:
# this package depends on nobody).
WORKER_TOKEN_ENV = "FERRY_WORKER_TOKEN"
WORKER_TOKEN_PREVIOUS_ENV = "FERRY_WORKER_TOKEN_PREVIOUS"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def validate_cidr(value: str, what: str) -> str:
    """``value`` as a normalized CIDR (``10.1.0.0/16``, ``fd00::/64``).

    Raises:
        InvalidSpec: not an IPv4/IPv6 network in CIDR notation, or with host bits set.
    """
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except (TypeError, ValueError) as exc:
        raise InvalidSpec(f"{what}: {value!r} is not a CIDR such as 10.1.0.0/16 ({exc})") from exc


class BackendError(Exception):
    """Base class of every orchestrator backend error. ``retryable`` tells callers what to do."""

    retryable = False


class BackendUnavailable(BackendError):
    """The backend was unreachable, timed out or answered 5xx/429 after bounded backoff. Retry later."""

    retryable = True


class Conflict(BackendError):
    """A concurrent writer changed the object on every bounded re-read-and-retry (HTTP 409)."""


class NotFound(BackendError):
    """The pool, track or replica does not exist in the backend (HTTP 404)."""


class InvalidSpec(BackendError, ValueError):
    """The spec cannot be applied as given (bad name, label, count); fix the spec, do not retry."""


def validate_dns_label(value: str, what: str, max_len: int = 63) -> str:
    """Return ``value`` if it is an RFC 1123 DNS label of at most ``max_len`` characters.

    Raises:
        InvalidSpec: naming ``what`` and the rule, e.g. "pool name 'Decode_A' must be lowercase ...".
    """
    if not isinstance(value, str) or len(value) > max_len or not _DNS_LABEL.match(value):
        raise InvalidSpec(
            f"{what} {value!r} must be lowercase letters, digits and '-', start and end with a letter "
            f"or digit, at most {max_len} characters"
        )
    return value


def validate_label_value(value: str, what: str) -> str:
    """Return ``value`` if it is a valid Kubernetes label value (<= 63 chars, [A-Za-z0-9._-]).

    Raises:
        InvalidSpec: naming ``what``.
    """
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        raise InvalidSpec(
            f"{what} {value!r} is not a valid label value: at most 63 characters of letters, digits, "
            "'-', '_' and '.', starting and ending with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class PoolRef:
    """Identifies one pool inside one cluster (what every verb but ``apply_pool_track`` takes)."""

    pool_id: int
    pool_name: str  # DNS label; object and process names derive from it
    namespace: str = "default"  # Kubernetes namespace; ignored by the local backend

    def __post_init__(self) -> None:
        if not isinstance(self.pool_id, int) or self.pool_id < 0:
            raise InvalidSpec(f"pool_id must be a non-negative integer, got {self.pool_id!r}")
        validate_dns_label(self.pool_name, "pool name", max_len=40)
        validate_dns_label(self.namespace, "namespace")


@dataclass(frozen=True)
class ModelRef:
    """The model version a track serves."""

    name: str  # e.g. "gemma-3-270m": passed to the worker as --model
    version: str  # label value, e.g. "v1" or "2026-11-30"
    image: str = "ferry/inference-worker:latest"  # container image (Kubernetes only)
    weights_uri: str = ""  # http(s):// or file:// URI the init step fetches; "" = baked into the image
    sha256: str = ""  # lowercase hex digest of the weights file; required when weights_uri is set
    # Local backend only: the prepared model on this host (a directory or file). When set the worker loads
    # it (--model PATH) and still answers to ``name`` (--served-model-name), so two versions of one model
    # (e.g. fp32 and bf16 artifacts) run their own weights under the same API model id.
    local_path: str = ""

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise InvalidSpec(f"model name {self.name!r} must be non-empty without whitespace")
        validate_label_value(self.version, "model version")
        if self.weights_uri and not _SHA256.match(self.sha256):
            raise InvalidSpec("sha256 must be 64 lowercase hex characters when weights_uri is set")


@dataclass(frozen=True)
class Toleration:
    """A Kubernetes toleration (https://kubernetes.io/docs/concepts/scheduling-eviction/taint-and-toleration/)."""

    key: str
    operator: str = "Equal"  # Equal | Exists
    value: str | None = None
    effect: str | None = None  # NoSchedule | PreferNoSchedule | NoExecute | None (all)

    def __post_init__(self) -> None:
        if self.operator not in ("Equal", "Exists"):
            raise InvalidSpec(f"toleration operator must be Equal or Exists, got {self.operator!r}")
        if self.effect not in (None, "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise InvalidSpec(f"toleration effect {self.effect!r} is not a Kubernetes taint effect")


@dataclass(frozen=True)
class Resources:
    """Per-replica resource requests (= limits for GPUs, as Kubernetes requires)."""

    gpu_count: int = 0
    gpu_kind: str = "nvidia.com/gpu"  # extended resource name
    cpu: str | None = None  # Kubernetes quantity, e.g. "2" or "500m"
    memory: str | None = None  # Kubernetes quantity, e.g. "8Gi"

    def __post_init__(self) -> None:
        if not isinstance(self.gpu_count, int) or self.gpu_count < 0:
            raise InvalidSpec(f"gpu_count must be a non-negative integer, got {self.gpu_count!r}")


@dataclass(frozen=True)
class PoolTrackSpec:
    """Everything a backend needs to run one track of one pool.

    ``worker_args()`` is the argument list after ``python -m inference_worker``; both backends run
    exactly that (Kubernetes as the container command, the local agent as a process).
    """

    pool: PoolRef
    role: str  # prefill | decode | colocated
    track: str  # stable | canary | blue | green
    model: ModelRef
    replicas: int
    port: int = 8000  # container port (Kubernetes); the local agent picks a free port instead
    extra_args: tuple[str, ...] = ()  # appended to the worker command, e.g. ("--max-num-seqs", "8")
    env: Mapping[str, str] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    drain_timeout_s: int = 30  # SIGTERM -> exit budget; terminationGracePeriodSeconds on Kubernetes
    labels: Mapping[str, str] = field(default_factory=dict)  # extra labels, merged under Ferry's
    kv_port: int | None = None
    """Decode workers' KV receiver port on Kubernetes (``--kv-port``; the NetworkPolicy opens it); None: any."""
    engine: str = "ferry"
    """The server the replicas run (:mod:`inference_worker.engine_kinds`): ``ferry`` (``worker_args``), ``vllm`` or
    ``sglang`` (Kubernetes only: the container follows the engine's CLI, its weights are a model directory)."""
    kv_peer_cidrs: tuple[str, ...] = ()
    """Addresses of the workers in linked clusters (``ClusterLink.source_cidrs`` of links into this cluster):
    they reach the KV port of decode pools and the HTTP port of prefill pools (remote prefill)."""
    worker_token: str = field(default="", repr=False)
    """The pool's worker token: the workers get it as ``FERRY_WORKER_TOKEN`` in their environment (never in
    ``worker_args()``, which ``ps`` shows), locally in the process env, on Kubernetes from a Secret per pool.
    "" = none (the workers run open)."""
    worker_token_previous: str = field(default="", repr=False)
    """The token before the pool's last rotation (``FERRY_WORKER_TOKEN_PREVIOUS``), still accepted; "" = none."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidSpec(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.track not in TRACKS:
            raise InvalidSpec(f"track must be one of {', '.join(TRACKS)}, got {self.track!r}")
        if not isinstance(self.replicas, int) or not 0 <= self.replicas <= 1000:
            raise InvalidSpec(f"replicas must be an integer in 0..1000, got {self.replicas!r}")
        if not 1 <= self.port <= 65535:
            raise InvalidSpec(f"port must be in 1..65535, got {self.port!r}")
        if not isinstance(self.drain_timeout_s, int) or not 1 <= self.drain_timeout_s <= 3600:
            raise InvalidSpec(f"drain_timeout_s must be an integer in 1..3600, got {self.drain_timeout_s!r}")
        if "--port" in self.extra_args:
            raise InvalidSpec("extra_args must not set --port: the backend owns the port")
        if self.kv_port is not None and (not 1 <= self.kv_port <= 65535 or self.kv_port == self.port):
            raise InvalidSpec(f"kv_port must be in 1..65535 and differ from port {self.port}, got {self.kv_port!r}")
        for cidr in self.kv_peer_cidrs:
            validate_cidr(cidr, "kv_peer_cidrs")
        if self.engine not in ENGINE_KINDS:
            raise InvalidSpec(f"engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine!r}")
        if self.engine != FERRY and self.role != "colocated":
            raise InvalidSpec(f"engine {self.engine!r} serves colocated pools only (the PD hand-off is Ferry's)")
        for token in (self.worker_token, self.worker_token_previous):
            if token and (len(token) < 16 or not token.isascii() or not token.isprintable() or " " in token):
                raise InvalidSpec("worker tokens must be at least 16 printable ASCII characters without spaces")
        if self.worker_token_previous and not self.worker_token:
            raise InvalidSpec("worker_token_previous needs a worker_token")
        if WORKER_TOKEN_ENV in self.env or WORKER_TOKEN_PREVIOUS_ENV in self.env:
            raise InvalidSpec(f"env must not set {WORKER_TOKEN_ENV}: the pool's worker token comes from the pool")
        for key, value in self.labels.items():
            if key.startswith("ferry.io/"):
                raise InvalidSpec(f"label {key!r}: the ferry.io/ prefix is reserved for Ferry's own labels")
            validate_label_value(value, f"label {key!r}")

    @property
    def object_name(self) -> str:
        """``<pool>-<track>``: the Deployment/Service name on Kubernetes, the process-name prefix locally."""
        return f"{self.pool.pool_name}-{self.track}"

    def ferry_labels(self) -> dict[str, str]:
        """The labels that identify this track's replicas everywhere (selectors use pool+track)."""
        return {
            **dict(self.labels),
            LABEL_POOL: self.pool.pool_name,
            LABEL_POOL_ID: str(self.pool.pool_id),
            LABEL_ROLE: self.role,
            LABEL_TRACK: self.track,
            LABEL_MODEL_VERSION: self.model.version,
        }

    def worker_token_env(self) -> dict[str, str]:
        """``{FERRY_WORKER_TOKEN: ..., FERRY_WORKER_TOKEN_PREVIOUS: ...}`` (each only when set): the environment
        that gives the workers their pool's credential (the local backend merges it into the process env)."""
        env = {WORKER_TOKEN_ENV: self.worker_token} if self.worker_token else {}
        if self.worker_token_previous:
            env[WORKER_TOKEN_PREVIOUS_ENV] = self.worker_token_previous
        return env

    def worker_args(self) -> list[str]:
        """Arguments after ``python -m inference_worker`` for ``serve``.

        Without ``--port`` and ``--replica``: the backend adds those (pod name / agent process name).
        """
        return [
            "serve",
            "--role", self.role,
            *(["--model", self.model.local_path, "--served-model-name", self.model.name] if self.model.local_path
              else ["--model", self.model.name]),
            "--model-version", self.model.version,
            "--pool", self.pool.pool_name,
            "--track", self.track,
            "--drain-timeout", str(self.drain_timeout_s),
            *self.extra_args,
        ]


@dataclass(frozen=True)
class ObservedReplica:
    """One running (or dead) replica as the backend sees it."""

    name: str  # backend id: pod name or agent process name
    track: str
    endpoint: str  # "http://host:port" of the worker, "" while unscheduled
    ready: bool  # /ready answered 200 (readiness probe / agent poll)
    alive: bool  # process/container running
    version: str  # model version label
    restart_count: int = 0
    exit_code: int | None = None  # last exit code if it died and the backend knows it
    exited_at: float | None = None  # Unix seconds of its last death, if known (reconcile's restart backoff)
    message: str = ""  # its last termination message ("model failed to load: ..."), "" if none


@dataclass(frozen=True)
class ObservedTrack:
    """Observed state of one track: desired replicas as the backend holds them, and the replicas."""

    track: str
    desired_replicas: int
    ready_replicas: int
    replicas: tuple[ObservedReplica, ...] = ()


@dataclass(frozen=True)
class ObservedState:
    """Observed state of one pool, read from the backend (never the source of truth for intent)."""

    pool_name: str
    tracks: Mapping[str, ObservedTrack] = field(default_factory=dict)
    active_track: str | None = None  # blue-green: the track the pool Service selects, if any


class OrchestratorBackend(abc.ABC):
    """DESIGN's backend verbs. Every method is idempotent: calling it twice has the effect of once."""

    @abc.abstractmethod
    def apply_pool_track(self, spec: PoolTrackSpec) -> None:
        """Create or update everything that runs ``spec`` and set its replicas to ``spec.replicas``."""

    @abc.abstractmethod
    def scale_track(self, pool: PoolRef, track: str, replicas: int) -> None:
        """Set the replica count of an applied track. Raises ``NotFound`` if it was never applied."""

    @abc.abstractmethod
    def set_traffic_weights(self, pool: PoolRef, weights: Mapping[str, int]) -> str:
        """Apply per-track traffic weights (percent, summing to 100).

        Returns ``ROUTING_TABLE`` when Ferry's router owns traffic (the caller publishes the routing
        table) or ``APPLIED`` when the backend moved traffic itself.
        """

    @abc.abstractmethod
    def switch_active(self, pool: PoolRef, active_track: str) -> str:
        """Blue-green: make ``active_track`` the one that serves. Returns ``ROUTING_TABLE`` or ``APPLIED``."""

    @abc.abstractmethod
    def delete_track(self, pool: PoolRef, track: str) -> None:
        """Stop and remove a track (draining its replicas). Deleting a missing track is a no-op."""

    @abc.abstractmethod
    def restart_replica(self, pool: PoolRef, replica: str) -> None:
        """Restart one replica by name (``ObservedReplica.name``). Raises ``NotFound``."""

    @abc.abstractmethod
    def observe(self, pool: PoolRef) -> ObservedState:
        """Read the pool's observed state: every track with desired/ready counts and its replicas."""

    @abc.abstractmethod
    def logs(self, pool: PoolRef, replica: str, tail: int = 100) -> str:
        """The last ``tail`` lines of a replica's stdout/stderr, at most :data:`MAX_LOG_BYTES` bytes (the end of
        the log is kept). Raises ``NotFound``."""


MAX_LOG_BYTES = 1 << 20
"""The most bytes of a replica's log a backend returns (1 MiB: 5000 lines of ~200 characters)."""


def log_text(data: bytes) -> str:
    """``data``'s last :data:`MAX_LOG_BYTES` bytes as text: invalid UTF-8 replaced, control characters other
    than tab and newline dropped, so the API shows log text and nothing a remote side could make it render."""
    text = data[-MAX_LOG_BYTES:].decode("utf-8", errors="replace")
    return "".join(ch for ch in text if ch in "\t\n" or (ch >= " " and ch != "\x7f"))


def validate_weights(weights: Mapping[str, int]) -> dict[str, int]:
    """Check per-track traffic weights: known tracks, integers 0..100, summing to 100.

    Raises:
        InvalidSpec: with the offending track or the actual sum.
    """
    result: dict[str, int] = {}
    for track, weight in weights.items():
        if track not in TRACKS:
            raise InvalidSpec(f"unknown track {track!r} in traffic weights")
        if not isinstance(weight, int) or not 0 <= weight <= 100:
            raise InvalidSpec(f"weight of track {track!r} must be an integer percent in 0..100, got {weight!r}")
        result[track] = weight
    if sum(result.values()) != 100:
        raise InvalidSpec(f"traffic weights must sum to 100, got {sum(result.values())}")
    return result
