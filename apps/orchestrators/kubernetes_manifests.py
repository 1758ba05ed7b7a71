"""Pure functions that build Kubernetes manifests (plain dicts) for pools, tracks and the router.

Per pool: a Secret ``<pool>-worker-token`` with the pool's worker token, which the workers read by
``secretKeyRef``. Per pool track: a Deployment, a headless Service (the router picks pods itself), a
PodDisruptionBudget and a NetworkPolicy (ingress only from routers, the control plane, Prometheus and,
for KV and remote prefill, peer workers and linked clusters' CIDRs), all named ``<pool>-<track>`` and
labelled ``ferry.io/pool``, ``ferry.io/role``, ``ferry.io/model-version``, ``ferry.io/track``. Per pool
(blue-green): a ClusterIP Service named ``<pool>`` selecting the active track. The router runs as its own
Deployment + Service (also rendered into Ferry's own Kustomize base, ``apps/setup/kube_manifests.py``),
optionally one per track (``--track``) behind a Gateway API HTTPRoute whose backendRefs weights
:func:`http_route_backend_refs` builds.
Nothing here talks to a cluster; the functions are unit-tested as data.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from apps.orchestrators.base import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_POOL,
    LABEL_ROLE,
    LABEL_TRACK,
    WORKER_TOKEN_ENV,
    WORKER_TOKEN_PREVIOUS_ENV,
    InvalidSpec,
    PoolRef,
    PoolTrackSpec,
    validate_dns_label,
)
from inference_worker.engine_kinds import FERRY, engine_container

WEIGHTS_DIR = "/models"
LABEL_ENGINE = "ferry.io/engine"
CONTAINER_NAME = "worker"

# Runs in the worker image (it has Python) as the init container: download the weights once,
# verify sha256, then move into place atomically. Reads WEIGHTS_URI, WEIGHTS_SHA256, WEIGHTS_PATH.
FETCH_WEIGHTS_SCRIPT = """\
import hashlib, os, shutil, sys, urllib.request
uri, want, path = os.environ["WEIGHTS_URI"], os.environ["WEIGHTS_SHA256"], os.environ["WEIGHTS_PATH"]
def digest(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
if os.path.exists(path) and digest(path) == want:
    sys.exit(0)
tmp = path + ".part"
with urllib.request.urlopen(uri) as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
got = digest(tmp)
if got != want:
    os.remove(tmp)
    sys.exit(f"sha256 mismatch for {uri}: got {got}, want {want}")
os.replace(tmp, path)
"""


# The same for an engine's model directory (vLLM, SGLang): WEIGHTS_URI is the directory's base URL, holding a
# SHA256SUMS file (`sha256sum` format, relative paths) whose own sha256 is WEIGHTS_SHA256. The sums file is checked
# first, then every file it lists is fetched and checked; WEIGHTS_PATH is the directory to fill.
FETCH_MODEL_DIR_SCRIPT = """\
import hashlib, os, posixpath, sys, urllib.request
base, want, root = os.environ["WEIGHTS_URI"].rstrip("/"), os.environ["WEIGHTS_SHA256"], os.environ["WEIGHTS_PATH"]
def digest(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
with urllib.request.urlopen(base + "/SHA256SUMS") as src:
    sums = src.read()
if hashlib.sha256(sums).hexdigest() != want:
    sys.exit(f"sha256 mismatch for {base}/SHA256SUMS: want {want}")
for line in sums.decode().splitlines():
    if not line.strip():
        continue
    expected, name = line.split(None, 1)
    name = name.lstrip("*")
    if name.startswith("/") or ".." in name.split("/"):
        sys.exit(f"SHA256SUMS names a path outside the model directory: {name!r}")
    path = posixpath.join(root, name)
    if os.path.exists(path) and digest(path) == expected:
        continue
    os.makedirs(posixpath.dirname(path), exist_ok=True)
    with urllib.request.urlopen(base + "/" + name) as src, open(path + ".part", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    if digest(path + ".part") != expected:
        os.remove(path + ".part")
        sys.exit(f"sha256 mismatch for {base}/{name}: want {expected}")
    os.replace(path + ".part", path)
"""
MODEL_DIR = f"{WEIGHTS_DIR}/model"
"""Where an engine's model directory lives in the pod (vLLM, SGLang)."""


def selector_labels(pool_name: str, track: str) -> dict[str, str]:
    """The immutable Deployment selector of one track: pool + track (never the model version)."""
    return {LABEL_POOL: pool_name, LABEL_TRACK: track}


def track_labels(spec: PoolTrackSpec) -> dict[str, str]:
    """All labels on a track's objects and pods; vLLM and SGLang pods also carry ``ferry.io/engine`` (a Prometheus
    ``kubernetes_sd`` job selects them by it to apply the engine's relabel rules)."""
    labels = {**spec.ferry_labels(), LABEL_COMPONENT: "inference-worker", LABEL_MANAGED_BY: "ferry"}
    if spec.engine != FERRY:
        labels[LABEL_ENGINE] = spec.engine
    return labels


def weights_path(spec: PoolTrackSpec) -> str:
    """Where the init container puts the weights inside the pod, e.g. ``/models/model.gguf``."""
    name = posixpath.basename(urlparse(spec.model.weights_uri).path) or "weights"
    return f"{WEIGHTS_DIR}/{name}"


WORKER_TOKEN_ANNOTATION = "ferry.io/worker-token-digest"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""Kubernetes' default ``terminationMessagePath``; the worker learns it from ``FERRY_TERMINATION_MESSAGE_PATH``."""


KV_LINK_SECRET_NAME = "ferry-kv-link"
"""The Secret, in the pool's namespace, holding the per-link KV secret under :data:`KV_LINK_SECRET_KEY`; the
operator creates it (README, "Deploy on Kubernetes") with the value the control plane has."""
KV_LINK_SECRET_KEY = "FERRY_KV_LINK_SECRET"


def kv_link_secret_env() -> dict:
    """The ``FERRY_KV_LINK_SECRET`` env var by reference to :data:`KV_LINK_SECRET_NAME` (``optional``: without
    the Secret a worker starts with disaggregation off and says so, as ``inference_worker serve`` does)."""
    return {"name": KV_LINK_SECRET_KEY, "valueFrom": {"secretKeyRef": {
        "name": KV_LINK_SECRET_NAME, "key": KV_LINK_SECRET_KEY, "optional": True}}}


WORKER_TOKEN_SECRET_SUFFIX = "-worker-token"
"""The pool's worker token Secret is ``<pool>-worker-token`` in the pool's namespace (pool names are <= 40
characters, so the name stays a DNS label)."""


def worker_token_secret_name(pool: PoolRef) -> str:
    return f"{pool.pool_name}{WORKER_TOKEN_SECRET_SUFFIX}"


def worker_token_secret_manifest(spec: PoolTrackSpec) -> dict:
    """v1 Secret ``<pool>-worker-token``: the pool's worker token under ``FERRY_WORKER_TOKEN`` and the one before
    its last rotation under ``FERRY_WORKER_TOKEN_PREVIOUS`` ("" when none, so a patch also clears it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": worker_token_secret_name(spec.pool), "namespace": spec.pool.namespace,
                     "labels": {LABEL_POOL: spec.pool.pool_name, LABEL_MANAGED_BY: "ferry"}},
        "type": "Opaque",
        "stringData": {WORKER_TOKEN_ENV: spec.worker_token, WORKER_TOKEN_PREVIOUS_ENV: spec.worker_token_previous},
    }


def worker_token_env(spec: PoolTrackSpec) -> list[dict]:
    """The worker's ``FERRY_WORKER_TOKEN`` and ``FERRY_WORKER_TOKEN_PREVIOUS`` by ``secretKeyRef`` to the pool's
    Secret (:func:`worker_token_secret_manifest`): never a value in the Deployment, which more people can read."""
    name = worker_token_secret_name(spec.pool)
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
            for key in (WORKER_TOKEN_ENV, WORKER_TOKEN_PREVIOUS_ENV)]


def worker_token_digest(spec: PoolTrackSpec) -> str:
    """First 16 hex digits of SHA-256 over the pool's tokens: a pod-template annotation, so a rotation changes the
    template and the Deployment rolls its pods onto the new Secret (env from a Secret is read at container start).
    A prefix of a hash of 256-bit random tokens tells nothing about them."""
    return hashlib.sha256(f"{spec.worker_token}\n{spec.worker_token_previous}".encode()).hexdigest()[:16]


def _resources(spec: PoolTrackSpec) -> dict:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if spec.resources.cpu:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpu_count:
        # Extended resources must have request == limit.
        requests[spec.resources.gpu_kind] = limits[spec.resources.gpu_kind] = str(spec.resources.gpu_count)
    return {"requests": requests, "limits": limits}


def engine_worker_container(spec: PoolTrackSpec) -> dict:
    """The container of a vLLM or SGLang replica: the engine's own CLI (:func:`inference_worker.engine_kinds.
    engine_container`) serving :data:`MODEL_DIR` (or, without ``weights_uri``, the model name, which the engine
    resolves itself), with probes on the engine's health paths and the same resources and drain as Ferry's. The
    pool's worker token is the engine's API key (vLLM reads ``VLLM_API_KEY``; SGLang gets ``--api-key`` expanded by
    the kubelet from the Secret-backed env), so the router's bearer token is checked by the engine itself; an
    engine accepts one key, so during a rotation the router's retry with the previous token covers the roll."""
    engine = engine_container(spec.engine, model_dir=MODEL_DIR if spec.model.weights_uri else spec.model.name,
                              served_model_name=spec.model.name, port=spec.port, extra_args=spec.extra_args,
                              api_key_env=WORKER_TOKEN_ENV if spec.worker_token else None)
    env = [{"name": key, "value": value} for key, value in sorted(spec.env.items())]
    if spec.worker_token:
        env.extend(worker_token_env(spec))
        env.extend({"name": name, "valueFrom": {"secretKeyRef": {"name": worker_token_secret_name(spec.pool),
                                                                 "key": WORKER_TOKEN_ENV}}}
                   for name in engine.api_key_env_names)
    container: dict = {
        "name": CONTAINER_NAME,
        "image": spec.model.image,
        "command": engine.command,
        "args": engine.args,
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "env": env,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": _resources(spec),
        "readinessProbe": {"httpGet": {"path": engine.ready_path, "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 1},
        "livenessProbe": {"httpGet": {"path": engine.health_path, "port": "http"}, "initialDelaySeconds": 30,
                          "periodSeconds": 10, "failureThreshold": 3},
        "startupProbe": {"httpGet": {"path": engine.health_path, "port": "http"}, "periodSeconds": 5,
                         "failureThreshold": 360},  # up to 30 minutes: large models and compile/graph capture
    }
    if spec.model.weights_uri:
        container["volumeMounts"] = [{"name": "weights", "mountPath": WEIGHTS_DIR}]
    return container


def worker_container(spec: PoolTrackSpec) -> dict:
    """The worker container: command, port, probes (/ready, /health), resources, env.

    ``FERRY_KV_LINK_SECRET`` comes from the Secret :data:`KV_LINK_SECRET_NAME` unless ``spec.env`` (the control
    plane's ``FERRY_WORKER_ENV``) sets it as a value; the pool's worker token from the pool's Secret
    (:func:`worker_token_env`) when the spec has one. A vLLM or SGLang track gets :func:`engine_worker_container`
    instead.
    """
    if spec.engine != FERRY:
        return engine_worker_container(spec)
    env = [{"name": key, "value": value} for key, value in sorted(spec.env.items())]
    env.append({"name": "FERRY_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    if spec.model.weights_uri:
        env.append({"name": "FERRY_WEIGHTS_PATH", "value": weights_path(spec)})
    # A fatal error (a model that fails to load) is written there and the worker exits non-zero; the
    # kubelet keeps it as the container's terminated.message, which observe() reports.
    env.append({"name": "FERRY_TERMINATION_MESSAGE_PATH", "value": TERMINATION_MESSAGE_PATH})
    if KV_LINK_SECRET_KEY not in spec.env:
        env.append(kv_link_secret_env())
    if spec.worker_token:
        env.extend(worker_token_env(spec))
    container: dict = {
        "name": CONTAINER_NAME,
        "image": spec.model.image,
        "command": ["python", "-m", "inference_worker"],
        # $(FERRY_REPLICA) is expanded by the kubelet from the env var below (the pod name).
        "args": [*spec.worker_args(), "--replica", "$(FERRY_REPLICA)",
                 "--host", "0.0.0.0", "--port", str(spec.port),  # noqa: S104 (listens on the pod IP)
                 *(["--kv-port", str(spec.kv_port)] if spec.kv_port is not None else [])],
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"},
                  *([{"name": "kv", "containerPort": spec.kv_port, "protocol": "TCP"}]
                    if spec.kv_port is not None else [])],
        "env": env,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",  # other crashes: the log tail is the message
        "resources": _resources(spec),
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 2,
            "failureThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 120,  # up to 10 minutes to load weights
        },
    }
    if spec.model.weights_uri:
        container["volumeMounts"] = [{"name": "weights", "mountPath": WEIGHTS_DIR}]
    return container


def fetch_weights_init_container(spec: PoolTrackSpec) -> dict:
    """Init container that downloads ``weights_uri`` and refuses to start on a sha256 mismatch.

    Ferry's worker: one weights file checked against ``sha256``. vLLM/SGLang: a model directory checked through
    its ``SHA256SUMS`` file, whose sha256 is ``sha256`` (:data:`FETCH_MODEL_DIR_SCRIPT`).
    """
    directory = spec.engine != FERRY
    return {
        "name": "fetch-weights",
        "image": spec.model.image,
        "command": ["python3", "-c", FETCH_MODEL_DIR_SCRIPT] if directory else ["python", "-c", FETCH_WEIGHTS_SCRIPT],
        "env": [
            {"name": "WEIGHTS_URI", "value": spec.model.weights_uri},
            {"name": "WEIGHTS_SHA256", "value": spec.model.sha256},
            {"name": "WEIGHTS_PATH", "value": MODEL_DIR if directory else weights_path(spec)},
        ],
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_DIR}],
    }


def deployment_manifest(spec: PoolTrackSpec) -> dict:
    """apps/v1 Deployment ``<pool>-<track>`` running ``spec.replicas`` workers.

    terminationGracePeriodSeconds = drain_timeout_s + 5: the worker drains on SIGTERM and the
    extra 5 s cover process exit before the kubelet's SIGKILL.
    """
    labels = track_labels(spec)
    pod_spec: dict = {
        "containers": [worker_container(spec)],
        "terminationGracePeriodSeconds": spec.drain_timeout_s + 5,
    }
    if spec.model.weights_uri:
        pod_spec["initContainers"] = [fetch_weights_init_container(spec)]
        pod_spec["volumes"] = [{"name": "weights", "emptyDir": {}}]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [
            {key: value for key, value in (
                ("key", tol.key), ("operator", tol.operator), ("value", tol.value), ("effect", tol.effect),
            ) if value is not None}
            for tol in spec.tolerations
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": spec.object_name, "namespace": spec.pool.namespace, "labels": labels},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(spec.pool.pool_name, spec.track)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(spec.port),
                        "prometheus.io/path": "/metrics",
                        **({WORKER_TOKEN_ANNOTATION: worker_token_digest(spec)} if spec.worker_token else {}),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def headless_service_manifest(spec: PoolTrackSpec) -> dict:
    """v1 Service ``<pool>-<track>`` with clusterIP None: DNS returns every ready pod for the router."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.object_name, "namespace": spec.pool.namespace, "labels": track_labels(spec)},
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(spec.pool.pool_name, spec.track),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
            "publishNotReadyAddresses": False,
        },
    }


def pod_disruption_budget_manifest(spec: PoolTrackSpec) -> dict:
    """policy/v1 PodDisruptionBudget: voluntary evictions take at most one replica of a track at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": spec.object_name, "namespace": spec.pool.namespace, "labels": track_labels(spec)},
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(spec.pool.pool_name, spec.track)},
        },
    }


def pool_service_manifest(pool: PoolRef, role: str, active_track: str, port: int = 8000) -> dict:
    """v1 Service ``<pool>`` selecting the blue-green active track (switch_active patches the selector)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": pool.pool_name,
            "namespace": pool.namespace,
            "labels": {LABEL_POOL: pool.pool_name, LABEL_ROLE: role, LABEL_MANAGED_BY: "ferry"},
        },
        "spec": {
            "selector": selector_labels(pool.pool_name, active_track),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


# Who may reach a worker's HTTP port besides peers: Ferry's routers and control plane (any namespace,
# by label) and Prometheus (the prometheus-operator's pod label), which scrapes /metrics.
ROUTER_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {LABEL_COMPONENT: "router",
                                                                        LABEL_MANAGED_BY: "ferry"}}}
CONTROL_PLANE_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {LABEL_PART_OF: "ferry"}}}
PROMETHEUS_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {LABEL_NAME: "prometheus"}}}


def network_policy_manifest(spec: PoolTrackSpec) -> dict:
    """networking.k8s.io/v1 NetworkPolicy ``<pool>-<track>``: ingress to the track's pods, nothing else.

    * the HTTP port from Ferry's routers and control plane and from Prometheus;
    * prefill pools: the HTTP port also from decode workers — in this namespace and at ``kv_peer_cidrs``
      (a decode worker calls ``/internal/prefill``);
    * decode pools with a ``kv_port``: the KV port from prefill workers in this namespace and from
      ``kv_peer_cidrs`` (the linked clusters; KV crosses datacenters by design).
    """
    def workers(role: str) -> dict:
        return {"podSelector": {"matchLabels": {LABEL_ROLE: role, LABEL_COMPONENT: "inference-worker"}}}

    peers = [{"ipBlock": {"cidr": cidr}} for cidr in spec.kv_peer_cidrs]
    http_from = [ROUTER_PEER, CONTROL_PLANE_PEER, PROMETHEUS_PEER]
    if spec.role == "prefill":
        http_from += [workers("decode"), *peers]
    ingress = [{"from": http_from, "ports": [{"protocol": "TCP", "port": spec.port}]}]
    if spec.kv_port is not None and spec.role == "decode":
        ingress.append({"from": [workers("prefill"), *peers], "ports": [{"protocol": "TCP", "port": spec.kv_port}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": spec.object_name, "namespace": spec.pool.namespace, "labels": track_labels(spec)},
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec.pool.pool_name, spec.track)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def track_manifests(spec: PoolTrackSpec) -> list[dict]:
    """Everything ``apply_pool_track`` creates, in apply order (the pool's worker token Secret, when the spec has a
    token, before the Deployment whose pods read it)."""
    secret = [worker_token_secret_manifest(spec)] if spec.worker_token else []
    return [*secret, deployment_manifest(spec), headless_service_manifest(spec), pod_disruption_budget_manifest(spec),
            network_policy_manifest(spec)]


@dataclass(frozen=True)
class RouterSpec:
    """The router Deployment: pulls the routing table from the control plane with a service token."""

    namespace: str
    image: str
    routing_table_url: str  # e.g. "http://ferry-web.ferry.svc:8000/api/v1/routing-table/"
    token_secret_name: str  # Secret holding the service token under key "token"
    name: str = "ferry-router"
    replicas: int = 2
    port: int = 8000
    cpu: str | None = "1"
    memory: str | None = "1Gi"
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    track: str | None = None
    """Pin the router to one track (``--track``): Gateway API traffic splitting, one router per track."""

    def __post_init__(self) -> None:
        validate_dns_label(self.name, "router name")
        validate_dns_label(self.namespace, "namespace")
        validate_dns_label(self.token_secret_name, "token secret name", max_len=253)
        if not self.routing_table_url.startswith(("http://", "https://")):
            raise InvalidSpec(f"routing_table_url must be http(s)://..., got {self.routing_table_url!r}")
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise InvalidSpec(f"router replicas must be a non-negative integer, got {self.replicas!r}")


def _router_labels(router: RouterSpec) -> dict[str, str]:
    # part-of=ferry: a router is one of Ferry's own pods (the pool NetworkPolicy's CONTROL_PLANE_PEER admits it
    # too, like the control plane's processes); component=router + managed-by=ferry is ROUTER_PEER.
    labels = {"app.kubernetes.io/name": router.name, LABEL_PART_OF: "ferry", LABEL_COMPONENT: "router",
              LABEL_MANAGED_BY: "ferry"}
    if router.track:
        labels[LABEL_TRACK] = router.track
    return labels


def router_deployment_manifest(router: RouterSpec) -> dict:
    """apps/v1 Deployment for ``python -m inference_worker router`` with the token from a Secret."""
    labels = _router_labels(router)
    requests = {key: value for key, value in (("cpu", router.cpu), ("memory", router.memory)) if value}
    container = {
        "name": "router",
        "image": router.image,
        "command": ["python", "-m", "inference_worker"],
        "args": [
            "router", "--routing-table", router.routing_table_url,
            *(["--track", router.track] if router.track else []), *router.extra_args, "--host", "0.0.0.0", "--port", str(router.port),  # noqa: S104 (pod IP)
        ],
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "env": [{
            "name": "FERRY_SERVICE_TOKEN",  # the router's bearer token for the routing-table pull
            "valueFrom": {"secretKeyRef": {"name": router.token_secret_name, "key": "token"}},
        }, {
            "name": "FERRY_ROUTER_API_KEY",  # the clients' key (the router refuses to start open)
            "valueFrom": {"secretKeyRef": {"name": router.token_secret_name, "key": "client-api-key"}},
        }],
        "resources": {"requests": requests, "limits": {"memory": router.memory} if router.memory else {}},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router.name, "namespace": router.namespace, "labels": labels},
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": router.name}},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(router.port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 30},
            },
        },
    }


def router_service_manifest(router: RouterSpec) -> dict:
    """v1 ClusterIP Service in front of the router pods (the OpenAI-compatible front door)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": router.name, "namespace": router.namespace, "labels": _router_labels(router)},
        "spec": {
            "selector": {"app.kubernetes.io/name": router.name},
            "ports": [{"name": "http", "port": router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


ROUTER_NAME = "ferry-router"
"""The router Deployment/Service of Ferry's own manifests; per-track routers are ``ferry-router-<track>``."""
ROUTER_PORT = 8080
GATEWAY_API_GROUP = "gateway.networking.k8s.io"
GATEWAY_API_VERSION = "v1"
HTTPROUTES = "httproutes"


def track_router(router: RouterSpec, track: str) -> RouterSpec:
    """The router pinned to ``track``: Deployment and ClusterIP Service ``<router>-<track>`` (``--track``)."""
    return RouterSpec(namespace=router.namespace, image=router.image, routing_table_url=router.routing_table_url,
                      token_secret_name=router.token_secret_name, name=f"{router.name}-{track}",
                      replicas=router.replicas, port=router.port, cpu=router.cpu, memory=router.memory,
                      extra_args=router.extra_args, track=track)


def http_route_backend_refs(router_name: str, port: int, weights: Mapping[str, int]) -> list[dict]:
    """HTTPRoute ``backendRefs``: the Service ``<router_name>-<track>`` of each track with its weight (percent),
    in ``weights`` order. Fields written (Gateway API v1 HTTPBackendRef): group, kind, name, port, weight."""
    return [{"group": "", "kind": "Service", "name": f"{router_name}-{track}", "port": port, "weight": weight}
            for track, weight in weights.items()]
