"""A local Kubernetes API for tests: kmock's KubernetesEmulator on a real port, plus a fake controller.

kmock 0.8's emulator stores objects and serves create/patch/list/watch over HTTP, but three gaps
matter for the official Python client, so ``FerryEmulator`` extends it (kmock's documented way:
"inherit and implement for your cases"):

* the Python client sends ``?watch=True`` while kmock only recognises ``watch=true`` (it would
  answer a plain list), so ``watch=True`` is routed to the emulator's watch stream;
* ``timeoutSeconds`` on watches is not implemented (kmock TODO), so the stream is ended after it;
* ``labelSelector`` is ignored on list and watch, so equality selectors (``k=v,k2=v2``) are applied.

The emulator runs in its own thread and event loop because the official client is synchronous.
``FakeController`` plays the Deployment + ReplicaSet controllers through the official client:
it creates one pod per desired replica, marks it Ready after ``ready_delay_s`` and writes the
Deployment status (``replicas``, ``readyReplicas``). It runs no containers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from typing import Any

import attrs
import kmock
from kubernetes import client

DEPLOYMENTS = kmock.resource("apps/v1/deployments")
SERVICES = kmock.resource("v1/services")
PODS = kmock.resource("v1/pods")
PDBS = kmock.resource("policy/v1/poddisruptionbudgets")
NETWORK_POLICIES = kmock.resource("networking.k8s.io/v1/networkpolicies")
HTTPROUTES = kmock.resource("gateway.networking.k8s.io/v1/httproutes")


def parse_selector(selector: str | None) -> dict[str, str]:
    if not selector:
        return {}
    pairs = (term.split("=", 1) for term in selector.split(","))
    return {key.strip(): value.strip() for key, value in pairs}


def merge_patch(target: Any, patch: Any) -> Any:
    """JSON merge patch (RFC 7386): objects merge key by key, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


@attrs.define(kw_only=True)
class FerryEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for resource in ("apps/v1/deployments", "v1/pods", "v1/services", "policy/v1/poddisruptionbudgets",
                         "networking.k8s.io/v1/networkpolicies", "gateway.networking.k8s.io/v1/httproutes"):
            self.resources[resource] = {}  # a real API server knows these even with no objects
        # Above the emulator's own list fallback (sub-priority 1 within the fallback level).
        (self.fallback ** 1)[{"watch": "True"}] << self._serve_python_watch

    async def _handle(self, request: Any) -> Any:
        """Set ``metadata.generation`` as the API server does: 1 on create, +1 when a patch changes the spec
        (a patch that leaves the spec as it was, or a status write, keeps it)."""
        if request.resource is not None and request.subresource is None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                request.data.setdefault("metadata", {})["generation"] = 1
            elif request.action == kmock.action.UPDATE and "spec" in request.data:
                key = (request.resource, request.namespace, request.name)
                if key in self._objects and not self._objects[key].deleted:
                    current = json.loads(json.dumps(self._objects[key].raw))
                    if merge_patch(current.get("spec"), request.data["spec"]) != current.get("spec"):
                        generation = int(current.get("metadata", {}).get("generation") or 0) + 1
                        request.data.setdefault("metadata", {})["generation"] = generation
        return await super()._handle(request)

    async def _serve_list(self, request: Any) -> Any:
        listing = await super()._serve_list(request)
        selector = parse_selector(request.params.get("labelSelector"))
        listing["items"] = [item for item in listing["items"] if matches(item, selector)]
        return listing

    async def _serve_python_watch(self, request: Any) -> Any:
        timeout_s = float(request.params.get("timeoutSeconds", "3600"))
        selector = parse_selector(request.params.get("labelSelector"))
        deadline = asyncio.get_running_loop().time() + timeout_s
        events = self._serve_watch(request)
        try:
            while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
                try:
                    item = await asyncio.wait_for(anext(events), remaining)
                except (TimeoutError, StopAsyncIteration):
                    return
                if isinstance(item, bytes) or matches(item.get("object", {}), selector):
                    yield item
        finally:
            await events.aclose()


class KubeMock:
    """The emulator served on 127.0.0.1:<random port> from a background thread."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.url = ""
        self.emulator: FerryEmulator | None = None

    def __enter__(self) -> KubeMock:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("kmock emulator did not start within 10 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with FerryEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    @property
    def k(self) -> FerryEmulator:
        if self.emulator is None:
            raise RuntimeError("KubeMock is not running")
        return self.emulator

    def obj(self, resource: kmock.resource, namespace: str, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self.k.objects or self.k.objects[key].deleted:
            return None
        return json.loads(json.dumps(self.k.objects[key].raw))

    def requests(self, method: str, path_suffix: str, **params: str) -> list[Any]:
        """Requests seen so far with this HTTP method whose path ends with ``path_suffix``."""
        return [
            r for r in list(self.k)
            if r.method.value == method.upper() and r.url.path.endswith(path_suffix)
            and all(r.params.get(key) == value for key, value in params.items())
        ]

    def kubeconfig(self, path: str) -> str:
        """Write a kubeconfig file whose context "mock" points at the emulator; returns ``path``."""
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "mock",
            "clusters": [{"name": "mock", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "mock", "context": {"cluster": "mock", "user": "tester", "namespace": "ferry"}}],
        }
        with open(path, "w") as fh:
            json.dump(doc, fh)
        return path


def api_client(url: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    configuration.client_side_validation = False
    return client.ApiClient(configuration)


class FakeController(threading.Thread):
    """Deployment/ReplicaSet controller stand-in speaking the official client to the emulator."""

    def __init__(self, url: str, namespace: str, *, ready_delay_s: float = 0.3, period_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        api = api_client(url)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.ready_delay_s = ready_delay_s
        self.period_s = period_s
        self._stop_event = threading.Event()
        self._ids = itertools.count()
        self._created_at: dict[str, float] = {}
        self.errors: list[Exception] = []

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            try:
                self.reconcile_once()
            except (client.ApiException, OSError) as exc:
                self.errors.append(exc)  # the emulator is shutting down or a test injected an error

    def reconcile_once(self) -> None:
        ns = self.namespace
        for dep in self.apps.list_namespaced_deployment(ns).items:
            selector = dep.spec.selector.match_labels
            label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
            pods = [p for p in self.core.list_namespaced_pod(ns, label_selector=label_selector).items
                    if p.metadata.name.startswith(dep.metadata.name + "-")]
            desired = dep.spec.replicas or 0
            for pod in pods[desired:]:
                self.core.delete_namespaced_pod(pod.metadata.name, ns)
                self._created_at.pop(pod.metadata.name, None)
            pods = pods[:desired]
            for _ in range(desired - len(pods)):
                pods.append(self._create_pod(dep))
            now = time.monotonic()
            ready = 0
            for pod in pods:
                name = pod.metadata.name
                if now - self._created_at.setdefault(name, now) >= self.ready_delay_s:
                    ready += 1
                    if not any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
                        self.core.patch_namespaced_pod_status(name, ns, {"status": {
                            "conditions": [{"type": "Ready", "status": "True"}]}})
            status = dep.status
            if status is None or (status.replicas, status.ready_replicas) != (len(pods), ready):
                self.apps.patch_namespaced_deployment_status(dep.metadata.name, ns, {"status": {
                    "replicas": len(pods), "readyReplicas": ready, "availableReplicas": ready,
                    "updatedReplicas": len(pods), "observedGeneration": 1}})

    def _create_pod(self, dep: Any) -> Any:
        n = next(self._ids)
        name = f"{dep.metadata.name}-{n:05d}"
        template = dep.spec.template
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "labels": dict(template.metadata.labels)},
            "spec": self.apps.api_client.sanitize_for_serialization(template.spec),
            "status": {"phase": "Running", "podIP": f"10.0.{n // 250}.{n % 250 + 1}",
                       "conditions": [{"type": "Ready", "status": "False"}],
                       "containerStatuses": [{"name": "worker", "ready": False, "restartCount": 0,
                                              "image": template.spec.containers[0].image, "imageID": "",
                                              "lastState": {}}]},
        }
        self._created_at[name] = time.monotonic()
        return self.core.create_namespaced_pod(self.namespace, body)


class FakeGateway(threading.Thread):
    """A Gateway controller stand-in: accepts each new generation of HTTPRoute ``route`` after ``delay_s``,
    writing ``status.parents[0].conditions`` (``Accepted=True``, ``observedGeneration``) as a real one does."""

    def __init__(self, url: str, namespace: str, route: str, *, delay_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.custom = client.CustomObjectsApi(api_client(url))
        self.namespace = namespace
        self.route = route
        self.delay_s = delay_s
        self.accepted: list[list[int]] = []  # the backendRefs weights of every generation it accepted
        self._stop_event = threading.Event()

    def run(self) -> None:
        group, ns = "gateway.networking.k8s.io", self.namespace
        while not self._stop_event.wait(self.delay_s):
            route = self.custom.get_namespaced_custom_object(group, "v1", ns, "httproutes", self.route)
            generation = route["metadata"]["generation"]
            parents = (route.get("status") or {}).get("parents") or []
            if parents and parents[0]["conditions"][0]["observedGeneration"] == generation:
                continue
            self.accepted.append([ref.get("weight", 1) for ref in route["spec"]["rules"][0]["backendRefs"]])
            self.custom.patch_namespaced_custom_object_status(group, "v1", ns, "httproutes", self.route, {
                "status": {"parents": [{"parentRef": {"name": "public"}, "controllerName": "example.com/gateway",
                                        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                                        "observedGeneration": generation}]}]}})

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)
