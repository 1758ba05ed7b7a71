"""Ferry's Kubernetes manifests (deploy/kubernetes): generated from one source each, rendered with
``kubectl kustomize``, validated against a current Kubernetes minor's schemas (``kubernetes-validate``,
offline), and checked as data: probes and resources on every container, singletons, commands equal to the
launcher's process list, the router equal to the backend's manifest, and an orchestrator Role that grants
exactly the API calls the Kubernetes backend makes (recorded against the emulator during its flows).
"""

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kmock
import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from apps.orchestrators.base import ModelRef, PoolRef, PoolTrackSpec
from apps.orchestrators.kubernetes_backend import KubernetesBackend
from apps.orchestrators.kubernetes_manifests import (
    GATEWAY_API_GROUP,
    HTTPROUTES,
    PROMETHEUS_PEER,
    RouterSpec,
    network_policy_manifest,
    router_deployment_manifest,
    track_manifests,
    track_router,
)
from apps.orchestrators.tests.kube_mock import PODS, FakeController, KubeMock, api_client
from apps.orchestrators.tests.test_kubernetes_gateway import check_backend_refs
from apps.setup import kube_manifests as km
from apps.setup.procfile import LaunchConfig, procfile
from inference_worker.tests.support.agent import wait_for

OVERLAYS = {"dev": "ferry-dev", "production": "ferry"}  # overlay -> namespace
KUBERNETES_VERSION = kubernetes_validate.latest_version()  # the newest minor the pinned package ships (1.37)
CONTROLLER_AGENT = "fake-controller"


def render(path: str, root: Path = km.DEPLOY_DIR) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not installed")
    result = subprocess.run([kubectl, "kustomize", str(root / path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_with_gateway(overlay: str, tmp: Path) -> list[dict]:
    """The overlay with ``components: [../../components/gateway]`` added, as the README tells the operator."""
    root = tmp / "kubernetes"
    shutil.copytree(km.DEPLOY_DIR, root)
    kustomization = root / "overlays" / overlay / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + "components:\n  - ../../components/gateway\n")
    return render(f"overlays/{overlay}", root)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    return {name: render(f"overlays/{name}") for name in OVERLAYS} | {
        "managed-cluster": render("managed-cluster"),
        "production+gateway": render_with_gateway("production", tmp_path_factory.mktemp("gateway"))}


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_generated_files_are_committed_as_generated():
    stale = [str(path.relative_to(km.BASE_DIR)) for path, text in km.generated_files().items()
             if not path.exists() or path.read_text() != text]
    assert stale == [], "run `python -m apps.setup.kube_manifests` and commit the result"


def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered):
    for name, docs in rendered.items():
        for doc in docs:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(by_kind(rendered["production"], "Deployment")["ferry-web"])
    broken["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator is live, not a no-op
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_gateway_component_and_the_backends_pool_manifests_validate_too():
    routers = list(yaml.safe_load_all(km.generated_files()[km.DEPLOY_DIR / "components" / "gateway" / "routers.yaml"]))
    assert [(d["kind"], d["metadata"]["name"]) for d in routers] == [
        (kind, f"ferry-router-{track}") for track in ("stable", "canary")
        for kind in ("Deployment", "Service", "PodDisruptionBudget")]
    assert missing_probes_or_resources(routers) == []
    spec = PoolTrackSpec(pool=PoolRef(pool_id=1, pool_name="decode-a", namespace="ferry"), role="decode",
                         track="canary", replicas=2, kv_port=8001, kv_peer_cidrs=("10.8.0.0/16", "fd00:8::/64"),
                         model=ModelRef(name="gemma-3-270m", version="v2", image="worker:v2",
                                        weights_uri="https://models.example/g.gguf", sha256="ab" * 32),
                         worker_token="decode-a-worker-token-0123", worker_token_previous="decode-a-old-token-0123")
    assert track_manifests(spec)[0]["kind"] == "Secret"
    for doc in routers + track_manifests(spec):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def missing_probes_or_resources(docs: list[dict]) -> list[str]:
    """``<deployment>/<container>: <what>`` for each container without readiness/liveness probes,
    CPU and memory requests, or a memory limit."""
    problems = []
    for dep in by_kind(docs, "Deployment").values():
        for container in dep["spec"]["template"]["spec"]["containers"]:
            where = f"{dep['metadata']['name']}/{container['name']}"
            problems += [f"{where}: no {probe}" for probe in ("readinessProbe", "livenessProbe") if probe not in container]
            resources = container.get("resources") or {}
            problems += [f"{where}: no {kind} {res}" for kind, res in (("requests", "cpu"), ("requests", "memory"),
                                                                      ("limits", "memory"))
                         if res not in (resources.get(kind) or {})]
    return problems


def test_every_container_has_probes_and_resources_and_the_check_catches_a_gap(rendered):
    for name in OVERLAYS:
        assert missing_probes_or_resources(rendered[name]) == []
    docs = copy.deepcopy(rendered["production"])
    beat = by_kind(docs, "Deployment")["ferry-beat"]["spec"]["template"]["spec"]["containers"][0]
    del beat["livenessProbe"], beat["resources"]["limits"]
    assert missing_probes_or_resources(docs) == ["ferry-beat/beat: no livenessProbe", "ferry-beat/beat: no limits memory"]


def test_processes_beat_and_poller_are_singletons_and_workers_scale(rendered):
    deployments = by_kind(rendered["production"], "Deployment")
    strategies = {name: (d["spec"]["replicas"], d["spec"].get("strategy", {}).get("type"))
                  for name, d in deployments.items()}
    assert strategies == {  # the router's strategy is the backend's (Kubernetes' default RollingUpdate)
        "ferry-web": (3, "RollingUpdate"), "ferry-worker": (4, "RollingUpdate"), "ferry-ticks": (1, "RollingUpdate"),
        "ferry-beat": (1, "Recreate"), "ferry-telemetry": (1, "Recreate"), "ferry-router": (3, None)}
    assert set(by_kind(rendered["production"], "PodDisruptionBudget")) == {"ferry-web", "ferry-worker", "ferry-router"}
    assert {d["spec"]["replicas"] for d in by_kind(rendered["dev"], "Deployment").values()} == {1}


def test_commands_are_the_launchers_process_list(rendered):
    lines = procfile(LaunchConfig(host="0.0.0.0", port=8000, router_port=8080, var_dir=km.VAR_DIR),  # noqa: S104
                     python="python").splitlines()
    expected = {line.split(": ", 1)[0]: line.split(": ", 1)[1].removeprefix("exec ").replace(
        str(km.VAR_DIR.resolve()), str(km.VAR_DIR)) for line in lines}
    deployments = by_kind(rendered["production"], "Deployment")
    for name in ("web", "worker", "ticks", "beat", "telemetry"):
        assert " ".join(deployments[f"ferry-{name}"]["spec"]["template"]["spec"]["containers"][0]["command"]) == \
            expected[name]
    router = deployments["ferry-router"]["spec"]["template"]["spec"]["containers"][0]
    flags = {arg for arg in router["args"] if arg.startswith("--")}
    # same options, pod values; client keys come in the routing table, plus the Secret's FERRY_ROUTER_API_KEY
    assert flags == {arg for arg in expected["router"].split() if arg.startswith("--")}
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in router["env"]}
    assert env["FERRY_ROUTER_API_KEY"] == {"name": "ferry-service-token", "key": "client-api-key"}


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_overlays_router_is_the_backends_router_manifest(rendered, overlay):
    docs = rendered[overlay]
    deployment = by_kind(docs, "Deployment")["ferry-router"]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    spec = RouterSpec(namespace=OVERLAYS[overlay], image=image, routing_table_url=km.ROUTER.routing_table_url,
                      token_secret_name=km.ROUTER.token_secret_name, name=km.ROUTER.name,
                      replicas=deployment["spec"]["replicas"], port=km.ROUTER.port, extra_args=km.ROUTER.extra_args)
    assert deployment == router_deployment_manifest(spec)
    assert image == {"dev": "ferry:dev", "production": "registry.example.com/ferry/ferry:1.0.0"}[overlay]


def verb(request) -> str:
    method = request.method.value
    if method == "GET":
        if request.name is not None and request.params.get("watch") not in ("true", "True"):
            return "get"
        return "watch" if request.params.get("watch") in ("true", "True") else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]


def backend_calls(mock: KubeMock) -> set[tuple[str, str, str]]:
    """(API group, resource[/subresource], verb) of every request the backend (not the fake controllers) made."""
    calls = set()
    for request in list(mock.k):
        if request.resource is None or request.headers.get("User-Agent") == CONTROLLER_AGENT:
            continue
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.add((request.resource.group or "", resource, verb(request)))
    return calls


def exercise_backend(mock: KubeMock) -> None:
    """Every verb of the Kubernetes backend, including create -> 409 -> patch and the Gateway calls."""
    ns = "ferry"
    controller = FakeController(mock.url, ns, ready_delay_s=0.05, period_s=0.02)
    controller.apps.api_client.user_agent = CONTROLLER_AGENT
    controller.start()
    setup = api_client(mock.url)
    setup.user_agent = CONTROLLER_AGENT
    # the operator creates the HTTPRoute (with its parentRefs); the backend only reads and patches it
    # (the README's example route, as the operator applies it)
    route = km.example_http_route()
    client.CustomObjectsApi(setup).create_namespaced_custom_object(GATEWAY_API_GROUP, "v1", ns, HTTPROUTES, route)
    mock.k["get", PODS, kmock.subresource("log")] << b"ready\n"
    backend = KubernetesBackend(api_client(mock.url), backoff_s=0.01, max_attempts=3, sleep=lambda s: None)
    pool = PoolRef(pool_id=1, pool_name="decode-a", namespace=ns)
    spec = PoolTrackSpec(pool=pool, role="decode", track="stable", replicas=1, kv_port=8001,
                         model=ModelRef(name="gemma-3-270m", version="v1", image="worker:v1"),
                         worker_token="decode-a-worker-token-0123")  # its Secret: create -> 409 -> patch
    try:
        backend.apply_pool_track(spec)
        backend.apply_pool_track(spec)  # AlreadyExists -> patch
        backend.scale_track(pool, "stable", 2)
        assert backend.wait_track_ready(pool, "stable", 2, timeout_s=10)
        assert backend.switch_active(pool, "stable") == "applied"
        state = wait_for(lambda: backend.observe(pool), 5, 0.05)
        replica = state.tracks["stable"].replicas[0].name
        assert backend.logs(pool, replica, tail=5) == "ready\n"
        backend.restart_replica(pool, replica)
        router = km.ROUTER
        backend.apply_router(track_router(RouterSpec(namespace=ns, image=router.image,
                                                     routing_table_url=router.routing_table_url,
                                                     token_secret_name=router.token_secret_name), "stable"))
        name = route["metadata"]["name"]
        generation = backend.set_route_weights(ns, name, "ferry-router", 8080, {"stable": 90, "canary": 10})
        assert backend.route_weights(ns, name, "ferry-router") == ({"stable": 90, "canary": 10}, generation)
        backend.route_accepted(ns, name, generation)
        backend.delete_track(pool, "stable")
    finally:
        controller.stop()


def granted(docs: list[dict]) -> set[tuple[str, str, str]]:
    (role,) = by_kind(docs, "Role").values()
    return {(group, resource, v) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for v in rule["verbs"]}


def test_orchestrator_role_grants_exactly_the_calls_the_backend_makes(rendered):
    with KubeMock() as mock:
        exercise_backend(mock)
        used = backend_calls(mock)
    assert ("", "pods/log", "get") in used and ("apps", "deployments", "watch") in used  # the recorder sees them
    for docs in (rendered["production"], rendered["dev"], rendered["managed-cluster"]):
        role = granted(docs)
        assert sorted(used - role) == [], "the Role lacks verbs the backend uses"
        assert sorted(role - used) == [], "the Role grants verbs the backend never uses"


def test_managed_cluster_bundle_binds_the_role_to_its_service_account_with_a_token(rendered):
    docs = rendered["managed-cluster"]
    (binding,) = by_kind(docs, "RoleBinding").values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": km.MANAGED_ACCOUNT, "namespace": "ferry-pools"}]
    assert by_kind(docs, "Secret")[f"{km.MANAGED_ACCOUNT}-token"]["type"] == "kubernetes.io/service-account-token"
    production = rendered["production"]
    accounts = {d["metadata"]["name"]: d["spec"]["template"]["spec"].get("serviceAccountName")
                for d in by_kind(production, "Deployment").values()}
    assert {name for name, sa in accounts.items() if sa == km.ORCHESTRATOR_ACCOUNT} == {
        "ferry-web", "ferry-worker", "ferry-ticks"}


def test_gateway_component_replaces_the_base_router_with_one_router_per_track(rendered):
    docs = rendered["production+gateway"]
    routers = {(d["kind"], d["metadata"]["name"]) for d in docs if "router" in d["metadata"]["name"]}
    assert routers == {(kind, f"ferry-router-{track}") for kind in ("Deployment", "Service", "PodDisruptionBudget")
                       for track in km.GATEWAY_TRACKS}  # no base ferry-router left as an unsplit entrance
    deployments = by_kind(docs, "Deployment")
    assert {name: d["spec"]["replicas"] for name, d in deployments.items() if "router" in name} == {
        "ferry-router-stable": 3, "ferry-router-canary": 3}  # the overlay's router count applies to both
    assert missing_probes_or_resources(docs) == []


def rendered_pods(rendered) -> dict[str, dict[str, str]]:
    """``{<render>/<deployment>: pod template labels}`` of every Deployment Ferry's manifests run."""
    return {f"{name}/{d['metadata']['name']}": d["spec"]["template"]["metadata"]["labels"]
            for name in (*OVERLAYS, "production+gateway") for d in by_kind(rendered[name], "Deployment").values()}


def admitted_by(labels: dict[str, str], peers: list[dict]) -> list[int]:
    """Indexes of the NetworkPolicy peers whose ``podSelector.matchLabels`` all appear in ``labels``."""
    return [i for i, peer in enumerate(peers) if peer["podSelector"]["matchLabels"].items() <= labels.items()]


def test_pool_network_policy_admits_every_ferry_pod_and_each_selector_selects_real_labels(rendered):
    spec = PoolTrackSpec(pool=PoolRef(pool_id=1, pool_name="decode-a", namespace="ferry"), role="decode",
                         track="stable", replicas=1, kv_port=8001,
                         model=ModelRef(name="gemma-3-270m", version="v1", image="worker:v1"))
    policy = network_policy_manifest(spec)
    (http,) = [rule for rule in policy["spec"]["ingress"] if rule["ports"] == [{"protocol": "TCP", "port": spec.port}]]
    # the peers from other namespaces: Ferry's routers, its control plane, Prometheus
    peers = [peer for peer in http["from"] if "namespaceSelector" in peer]
    pods = rendered_pods(rendered)
    assert {name: admitted_by(labels, peers) for name, labels in pods.items() if not admitted_by(labels, peers)} == {}
    ferry_peers = [i for i, peer in enumerate(peers) if peer != PROMETHEUS_PEER]
    unused = [peers[i] for i in ferry_peers if not any(i in admitted_by(labels, peers) for labels in pods.values())]
    assert unused == [], "a selector of the policy matches no pod Ferry runs"
    routers = {name: admitted_by(labels, peers) for name, labels in pods.items() if "router" in name}
    assert len(routers) == 4 and all(len(ids) == 2 for ids in routers.values()), routers  # ROUTER + part-of
    # the README names each selected label (Prometheus is outside the manifests: the README says which label)
    section = readme_section("Deploy on Kubernetes")
    assert [label for peer in peers for label in (f"`{k}: {v}`" for k, v in peer["podSelector"]["matchLabels"].items())
            if label not in " ".join(section.split())] == []
    stripped = {key: value for key, value in pods["production/ferry-web"].items() if key != "app.kubernetes.io/part-of"}
    assert admitted_by(stripped, peers) == []  # the check sees a pod the policy would block


README = km.BASE_DIR / "README.md"


def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def readme_commands() -> list[str]:
    """The shell lines of the README's "Deploy on Kubernetes" section, continuation lines joined."""
    section = readme_section("Deploy on Kubernetes").replace("\\\n", " ")
    return [" ".join(line.split()) for line in section.splitlines() if line.startswith("       ")]


def secret_references(docs: list[dict]) -> tuple[set[str], set[tuple[str, str]]]:
    """(Secrets read whole by ``envFrom``, (Secret, key) read by ``secretKeyRef``) of the rendered pods."""
    whole, keys = set(), set()
    for dep in by_kind(docs, "Deployment").values():
        for container in dep["spec"]["template"]["spec"]["containers"]:
            whole |= {ref["secretRef"]["name"] for ref in container.get("envFrom", []) if "secretRef" in ref}
            keys |= {(ref["name"], ref["key"]) for ref in (e.get("valueFrom", {}).get("secretKeyRef")
                                                            for e in container.get("env", [])) if ref}
    return whole, keys


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_readme_steps_create_what_each_overlay_references_in_its_namespace(rendered, overlay):
    docs = rendered[overlay]
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {OVERLAYS[overlay]}
    commands = readme_commands()
    assert f"NS={OVERLAYS[overlay]}" in commands  # the README sets $NS to the overlay's namespace ...
    assert {m for c in commands for m in re.findall(r"kubectl -n (\S+)", c)} == {'"$NS"'}  # ... and uses it
    images = {c["image"] for d in by_kind(docs, "Deployment").values() for c in d["spec"]["template"]["spec"]["containers"]}
    assert [image for image in images if not any(c.startswith(f"docker build -t {image} ") for c in commands)] == []
    created = {m.group(1): set(re.findall(r"--from-literal=([A-Za-z_-]+)=", c)) for c in commands
               if (m := re.search(r'kubectl -n "\$NS" create secret generic (\S+)', c))}
    whole, keys = secret_references(docs)
    assert sorted(whole - set(created)) == []
    assert sorted((name, key) for name, key in keys if key not in created.get(name, set())) == []
    # the exposure step names Services and ports the overlay has
    services = {(d["metadata"]["name"], p["port"]) for d in by_kind(docs, "Service").values() for p in d["spec"]["ports"]}
    exposed = {(name, int(port)) for c in commands if "create ingress" in c
               for name, port in re.findall(r"/\*=([a-z0-9-]+):(\d+)", c)}
    assert exposed and exposed <= services


def test_example_httproute_is_the_backends_backend_refs_to_the_gateway_components_services(rendered):
    (route,) = yaml.safe_load_all(km.generated_files()[km.DEPLOY_DIR / "components" / "gateway" / "httproute.example.yaml"])
    # structural check of Gateway API v1 HTTPRoute (no core schema in kubernetes-validate): the fields used
    assert (route["apiVersion"], route["kind"]) == (f"{GATEWAY_API_GROUP}/v1", "HTTPRoute")
    assert set(route) == {"apiVersion", "kind", "metadata", "spec"} and set(route["spec"]) == {"parentRefs", "rules"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", route["metadata"]["name"])
    assert [set(ref) for ref in route["spec"]["parentRefs"]] == [{"name"}]
    assert 1 <= len(route["spec"]["rules"]) <= 16
    for rule in route["spec"]["rules"]:
        assert set(rule) <= {"matches", "backendRefs"} and len(rule["matches"]) <= 64
        for match in rule["matches"]:
            assert match["path"]["type"] in ("Exact", "PathPrefix") and match["path"]["value"].startswith("/")
        check_backend_refs(rule["backendRefs"])
        services = {(d["metadata"]["name"], p["port"]) for d in by_kind(rendered["production+gateway"], "Service").values()
                    for p in d["spec"]["ports"]}
        assert {(ref["name"], ref["port"]) for ref in rule["backendRefs"]} <= services
        assert sum(ref["weight"] for ref in rule["backendRefs"]) == 100
