"""Ferry's own Kubernetes manifests (the Kustomize base in ``deploy/kubernetes/base``), built as data.

One source for each part:

* the commands of ``web``, ``worker``, ``ticks``, ``beat`` and ``telemetry`` are the launcher's process list
  (:func:`apps.setup.procfile.procfile`, rendered for a pod: listening on ``0.0.0.0``, ``python`` from the
  image, ``FERRY_VAR_DIR=/var/lib/ferry``). The local agent is not deployed: on Kubernetes the cluster's
  own controllers run the model workers (the ``kubernetes`` backend);
* the router Deployment and Service are the Kubernetes backend's :func:`router_deployment_manifest` and
  :func:`router_service_manifest` for :data:`ROUTER`;
* the orchestrator Role's rules (:data:`ORCHESTRATOR_RULES`) are checked against the API calls the backend
  makes (``apps/setup/tests/test_kube_manifests.py`` records them against the Kubernetes emulator), and the
  "managed cluster" bundle grants the same rules in a cluster Ferry reaches through a kubeconfig.

Configuration and Secrets are by reference: ``ferry-config`` (a ConfigMap in the base; overlays set
``FERRY_PROMETHEUS_URL`` and hosts) and the Secrets ``ferry-secrets`` (``DATABASE_URL``, ``REDIS_URL``,
``SECRET_KEY``), ``ferry-service-token`` (``token``, ``client-api-key``) and ``ferry-kv-link``
(``FERRY_KV_LINK_SECRET``, also read by the workers of in-cluster pools), which the operator creates (README, "Deploy on
Kubernetes"). ``python -m apps.setup.kube_manifests`` rewrites the generated YAML files; a test keeps the
committed files equal to :func:`generated_files`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import yaml

from apps.orchestrators.base import LABEL_COMPONENT, LABEL_NAME, LABEL_PART_OF
from apps.orchestrators.kubernetes_manifests import (
    GATEWAY_API_GROUP,
    GATEWAY_API_VERSION,
    ROUTER_NAME,
    ROUTER_PORT,
    RouterSpec,
    http_route_backend_refs,
    kv_link_secret_env,
    router_deployment_manifest,
    router_service_manifest,
    track_router,
)
from apps.setup.procfile import BASE_DIR, LaunchConfig, procfile

DEPLOY_DIR = BASE_DIR / "deploy" / "kubernetes"
NAMESPACE = "ferry"
IMAGE = "ferry:latest"
WEB_PORT = 8000
VAR_DIR = Path("/var/lib/ferry")
CONFIG_MAP = "ferry-config"
SECRETS = "ferry-secrets"
SERVICE_TOKEN_SECRET = "ferry-service-token"
ORCHESTRATOR_ACCOUNT = "ferry-orchestrator"
"""Service account of the processes that call the Kubernetes backend: web (logs, pool reads), worker
(Actions) and ticks (reconcile)."""
WORKLOAD_ACCOUNT = "ferry"
"""Service account of beat and the telemetry poller: no API token mounted, no role."""
MANAGED_ACCOUNT = "ferry-manager"
"""Service account in a managed cluster whose token goes into the kubeconfig Ferry uses there."""

ROUTER = RouterSpec(
    namespace=NAMESPACE, image=IMAGE, routing_table_url=f"http://ferry-web:{WEB_PORT}/api/v1/routing-table/",
    token_secret_name=SERVICE_TOKEN_SECRET, name=ROUTER_NAME, replicas=2, port=ROUTER_PORT,
    extra_args=("--log-level", "warning"),
)

# What the Kubernetes backend (apps/orchestrators/kubernetes_backend.py) may do in a pool namespace:
# (API group, resources, verbs). Least privilege: exactly the calls it makes (test_kube_manifests).
ORCHESTRATOR_RULES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("apps", ("deployments",), ("create", "delete", "get", "list", "patch", "watch")),
    ("apps", ("deployments/scale",), ("get", "patch")),
    ("", ("services",), ("create", "delete", "get", "patch")),
    ("", ("pods",), ("delete", "get", "list")),
    ("", ("pods/log",), ("get",)),
    ("", ("secrets",), ("create", "patch")),  # each pool's worker token (never read back)
    ("policy", ("poddisruptionbudgets",), ("create", "delete", "patch")),
    ("networking.k8s.io", ("networkpolicies",), ("create", "delete", "patch")),
    ("gateway.networking.k8s.io", ("httproutes",), ("get", "patch")),
)


def role_rules() -> list[dict]:
    """:data:`ORCHESTRATOR_RULES` as ``rbac.authorization.k8s.io/v1`` PolicyRules."""
    return [{"apiGroups": [group], "resources": list(resources), "verbs": list(verbs)}
            for group, resources, verbs in ORCHESTRATOR_RULES]


def process_commands() -> dict[str, list[str]]:
    """The launcher's process list rendered for a pod: ``{name: argv}`` (``exec`` dropped).

    Raises:
        ValueError: a Procfile line is not ``exec <argv>`` (the list changed shape; update this module).
    """
    config = LaunchConfig(host="0.0.0.0", port=WEB_PORT, router_port=ROUTER_PORT, var_dir=VAR_DIR,  # noqa: S104
                          workers=False, load=False)
    commands = {}
    for line in procfile(config, python="python").splitlines():
        name, _, command = line.partition(": ")
        argv = shlex.split(command)
        if not argv or argv[0] != "exec":
            raise ValueError(f"Procfile line {name!r} is not 'exec <argv>': {command!r}")
        # the launcher resolves var_dir on this machine (macOS: /var -> /private/var); the pod's path is VAR_DIR
        resolved = str(VAR_DIR.resolve())
        commands[name] = [arg.replace(resolved, str(VAR_DIR)) for arg in argv[1:]]
    return commands


def _labels(component: str) -> dict[str, str]:
    return {LABEL_NAME: f"ferry-{component}", LABEL_PART_OF: "ferry", LABEL_COMPONENT: component}


def _env() -> tuple[list[dict], list[dict]]:
    env_from = [{"configMapRef": {"name": CONFIG_MAP}}, {"secretRef": {"name": SECRETS}}]
    env = [{"name": "FERRY_SERVICE_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": SERVICE_TOKEN_SECRET, "key": "token"}}},
           # signs pool.flush_kv_cache resets: the same Secret the workers of in-cluster pools read
           kv_link_secret_env()]
    return env_from, env


def _exec_probe(argv: list[str], *, period_s: int, timeout_s: int, failures: int) -> dict:
    return {"exec": {"command": argv}, "periodSeconds": period_s, "timeoutSeconds": timeout_s,
            "failureThreshold": failures}


def _celery_ping(node: str) -> list[str]:
    # The node name of the procfile's `-n <node>@%h`; the pod's hostname is its name.
    return ["sh", "-c", f"exec python -m celery -A controlplane inspect ping --timeout 10 -d {node}@$HOSTNAME"]


PROBE_COMMAND = ["python", "manage.py", "ferry_probe"]


def _probes(name: str, argv: list[str]) -> dict:
    """readiness + liveness of each process: HTTP for web, Celery ping for workers, DB+Redis otherwise."""
    if name == "web":
        return {
            # /healthz answers 503 when the database or Redis is down: no traffic then, but no restart.
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http",
                                           "httpHeaders": [{"name": "Host", "value": "localhost"}]},
                               "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
            "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        }
    if "celery" in argv and "worker" in argv:
        node = argv[argv.index("-n") + 1].split("@", 1)[0]
        probe = _exec_probe(_celery_ping(node), period_s=60, timeout_s=20, failures=3)
        return {"readinessProbe": probe, "livenessProbe": probe}
    probe = _exec_probe(PROBE_COMMAND, period_s=60, timeout_s=20, failures=3)
    return {"readinessProbe": probe, "livenessProbe": probe}


# (replicas, cpu request, memory request = limit); beat and the poller are singletons.
SIZES = {
    "web": (2, "250m", "512Mi"),
    "worker": (2, "250m", "512Mi"),
    "ticks": (1, "100m", "384Mi"),
    "beat": (1, "50m", "256Mi"),
    "telemetry": (1, "100m", "384Mi"),
}
SINGLETONS = ("beat", "telemetry")
ORCHESTRATORS = ("web", "worker", "ticks")


def process_deployment(name: str, argv: list[str]) -> dict:
    """apps/v1 Deployment ``ferry-<name>`` running ``argv`` (probes, resources, config by reference)."""
    replicas, cpu, memory = SIZES[name]
    labels = _labels(name)
    env_from, env = _env()
    container: dict = {
        "name": name,
        "image": IMAGE,
        "command": argv,
        "envFrom": env_from,
        "env": env,
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}},
        **_probes(name, argv),
    }
    pod: dict = {
        "serviceAccountName": ORCHESTRATOR_ACCOUNT if name in ORCHESTRATORS else WORKLOAD_ACCOUNT,
        "automountServiceAccountToken": name in ORCHESTRATORS,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
        "containers": [container],
        "terminationGracePeriodSeconds": 60 if name in ("worker", "ticks") else 30,
    }
    if name == "web":
        container["ports"] = [{"name": "http", "containerPort": WEB_PORT, "protocol": "TCP"}]
        # the web server's --access-log file from the process list
        container["volumeMounts"] = [{"name": "log", "mountPath": str(VAR_DIR / "log")}]
        pod["volumes"] = [{"name": "log", "emptyDir": {}}]
    spec: dict = {
        "replicas": replicas,
        "selector": {"matchLabels": {LABEL_NAME: labels[LABEL_NAME]}},
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }
    # A singleton: never two schedulers/pollers at once, even during an update.
    spec["strategy"] = {"type": "Recreate"} if name in SINGLETONS else {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": f"ferry-{name}", "namespace": NAMESPACE, "labels": labels}, "spec": spec}


def pod_disruption_budget(name: str, match_labels: dict[str, str], labels: dict[str, str]) -> dict:
    """policy/v1 PodDisruptionBudget: voluntary evictions take one pod of ``name`` at a time."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": match_labels}}}


def config_map() -> dict:
    """``ferry-config``: non-secret settings; overlays set the Prometheus URL and the public hosts."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, "namespace": NAMESPACE, "labels": {LABEL_PART_OF: "ferry"}},
            "data": {
                "DEBUG": "0",
                "ALLOWED_HOSTS": "localhost,ferry-web",
                # TLS ends at the Ingress/Gateway; routers pull the routing table over the cluster network.
                "SECURE_SSL_REDIRECT": "0",
                "FERRY_PROMETHEUS_URL": "",
                "FERRY_VAR_DIR": str(VAR_DIR),
                "LOG_LEVEL": "INFO",
                # web processes per pod: the node's cores would be counted otherwise (a pod is sized by requests)
                "FERRY_WEB_WORKERS": "2",
            }}


def control_plane_objects() -> list[dict]:
    """ConfigMap, the process Deployments, the web Service and PodDisruptionBudgets."""
    commands = process_commands()
    objects: list[dict] = [config_map()]
    for name in SIZES:
        objects.append(process_deployment(name, commands[name]))
    web = _labels("web")
    objects.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "ferry-web", "namespace": NAMESPACE, "labels": web},
                    "spec": {"selector": {LABEL_NAME: web[LABEL_NAME]},
                             "ports": [{"name": "http", "port": WEB_PORT, "targetPort": "http", "protocol": "TCP"}]}})
    for name in ("web", "worker"):
        labels = _labels(name)
        objects.append(pod_disruption_budget(f"ferry-{name}", {LABEL_NAME: labels[LABEL_NAME]}, labels))
    return objects


def router_objects() -> list[dict]:
    """The router: the backend's Deployment and Service for :data:`ROUTER`, and its PodDisruptionBudget."""
    deployment = router_deployment_manifest(ROUTER)
    match = deployment["spec"]["selector"]["matchLabels"]
    return [deployment, router_service_manifest(ROUTER),
            pod_disruption_budget(ROUTER.name, dict(match), dict(deployment["metadata"]["labels"]))]


GATEWAY_TRACKS = ("stable", "canary")


def gateway_router_objects() -> list[dict]:
    """The ``gateway`` component: one router per track (``ferry-router-<track>``, ``--track``) behind its own
    ClusterIP Service and PodDisruptionBudget, for a cluster whose HTTPRoute splits traffic
    (``Cluster.gateway_httproute``). The component's kustomization removes the base ``ferry-router``: with it
    left in place a second, unsplit entrance would serve every track and bypass the canary's weights."""
    objects: list[dict] = []
    for track in GATEWAY_TRACKS:
        router = track_router(ROUTER, track)
        deployment = router_deployment_manifest(router)
        objects += [deployment, router_service_manifest(router),
                    pod_disruption_budget(router.name, dict(deployment["spec"]["selector"]["matchLabels"]),
                                          dict(deployment["metadata"]["labels"]))]
    return objects


GATEWAY_NAME = "ferry-gateway"
"""The Gateway the example HTTPRoute attaches to (the operator's own Gateway; edit ``parentRefs``)."""


def example_http_route() -> dict:
    """The HTTPRoute to copy for the ``gateway`` component: all traffic to ``ferry-router-stable`` (weight 100)
    and none to ``ferry-router-canary``; its backendRefs are what the rollout controller writes
    (:func:`http_route_backend_refs`), so a canary's first step patches only the weights."""
    return {"apiVersion": f"{GATEWAY_API_GROUP}/{GATEWAY_API_VERSION}", "kind": "HTTPRoute",
            "metadata": {"name": "ferry-chat", "labels": {LABEL_PART_OF: "ferry"}},
            "spec": {"parentRefs": [{"name": GATEWAY_NAME}],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                                "backendRefs": http_route_backend_refs(
                                    ROUTER_NAME, ROUTER_PORT, {"stable": 100, "canary": 0})}]}}


def rbac_objects() -> list[dict]:
    """Service accounts, the orchestrator Role and its RoleBinding (pools in Ferry's own namespace)."""
    meta = {"namespace": NAMESPACE, "labels": {LABEL_PART_OF: "ferry"}}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ORCHESTRATOR_ACCOUNT, **meta}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": WORKLOAD_ACCOUNT, **meta},
         "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": ORCHESTRATOR_ACCOUNT, **meta}, "rules": role_rules()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": ORCHESTRATOR_ACCOUNT, **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ORCHESTRATOR_ACCOUNT},
         "subjects": [{"kind": "ServiceAccount", "name": ORCHESTRATOR_ACCOUNT, "namespace": NAMESPACE}]},
    ]


def managed_cluster_objects() -> list[dict]:
    """The bundle for a cluster Ferry manages through a kubeconfig (applied in the pools' namespace).

    A ServiceAccount, a long-lived token Secret for the kubeconfig, and the orchestrator rules bound to it.
    """
    meta = {"namespace": NAMESPACE, "labels": {LABEL_PART_OF: "ferry"}}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": MANAGED_ACCOUNT, **meta}},
        {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
         "metadata": {"name": f"{MANAGED_ACCOUNT}-token", **meta,
                      "annotations": {"kubernetes.io/service-account.name": MANAGED_ACCOUNT}}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": MANAGED_ACCOUNT, **meta}, "rules": role_rules()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": MANAGED_ACCOUNT, **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": MANAGED_ACCOUNT},
         "subjects": [{"kind": "ServiceAccount", "name": MANAGED_ACCOUNT, "namespace": NAMESPACE}]},
    ]


HEADER = "# Generated by `python -m apps.setup.kube_manifests` from {source}; do not edit by hand.\n"


def _yaml(objects: list[dict], source: str) -> str:
    return HEADER.format(source=source) + yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def generated_files() -> dict[Path, str]:
    """``{path: YAML text}`` of every generated file under ``deploy/kubernetes``."""
    return {
        DEPLOY_DIR / "base" / "control-plane.yaml": _yaml(control_plane_objects(), "apps/setup/procfile.py"),
        DEPLOY_DIR / "base" / "router.yaml": _yaml(router_objects(), "the Kubernetes backend's router manifests"),
        DEPLOY_DIR / "base" / "rbac.yaml": _yaml(rbac_objects(), "ORCHESTRATOR_RULES"),
        DEPLOY_DIR / "components" / "gateway" / "routers.yaml": _yaml(
            gateway_router_objects(), "the Kubernetes backend's router manifests (one per track)"),
        DEPLOY_DIR / "components" / "gateway" / "httproute.example.yaml": _yaml(
            [example_http_route()], "the backend's HTTPRoute backendRefs (an example: not applied by the component)"),
        DEPLOY_DIR / "managed-cluster" / "rbac.yaml": _yaml(managed_cluster_objects(), "ORCHESTRATOR_RULES"),
    }


def main() -> int:
    for path, text in generated_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(BASE_DIR)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
