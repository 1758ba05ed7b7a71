"""Kubernetes orchestrator backend over the official ``kubernetes`` client.

Apply is create-then-patch (a 409 AlreadyExists on create becomes a patch of the whole manifest);
scale goes through the Deployment's scale subresource; readiness comes from the Deployment's
``status.readyReplicas`` and, per replica, from the pods' Ready condition. Failure policy:

* 409 Conflict on a write -> re-read and retry, at most ``max_conflict_retries`` times, then ``Conflict``;
* 5xx, 429, timeouts and connection errors -> exponential backoff (``backoff_s * 2**attempt``, capped at
  ``max_backoff_s``) for at most ``max_attempts`` attempts, then ``BackendUnavailable``;
* 404 -> ``NotFound``; 400/422 -> ``InvalidSpec``; anything else -> ``BackendError``.
Deletes are idempotent: gone or being deleted counts as deleted; ``observe`` skips objects being deleted.

Gateway API traffic splitting (HTTPRoute backendRefs weights, Accepted status): :mod:`.kubernetes_gateway`.

Watches (``watch_deployments``) run with a server-side timeout and a client read timeout, and on
410 Gone (the resourceVersion expired) they re-list and resume from the list's resourceVersion; repeated
410s and broken streams back off (``backoff_s * 2**n``, capped) instead of spinning.

**Every call is bounded in time.** The official client (``kubernetes.client.rest.RESTClientObject.request``,
v35) honours ``_request_timeout`` only as an ``int`` (a urllib3 total timeout) or a 2-tuple
``(connect_s, read_s)``; a ``float`` — ``10.0`` — matches neither branch and is silently dropped,
leaving the socket without a timeout (a stalled API server then hangs the caller for good). Every
request here therefore carries the tuple ``(request_timeout_s, request_timeout_s)``: at most
``request_timeout_s`` to connect and at most ``request_timeout_s`` of silence while reading. A call's
worst case, retries included, is ``call_bound_s``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config, watch

from apps.orchestrators import kubernetes_manifests as manifests
from apps.orchestrators.base import (
    APPLIED,
    LABEL_MODEL_VERSION,
    LABEL_POOL,
    LABEL_TRACK,
    MAX_LOG_BYTES,
    ROUTING_TABLE,
    TRACKS,
    BackendError,
    BackendUnavailable,
    Conflict,
    InvalidSpec,
    NotFound,
    ObservedReplica,
    ObservedState,
    ObservedTrack,
    OrchestratorBackend,
    PoolRef,
    PoolTrackSpec,
    log_text,
    validate_weights,
)
from apps.orchestrators.kubernetes_gateway import HTTPRouteWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KubeconfigRef:
    """Where a cluster's credentials come from (a Cluster row turns into one of these).

    Exactly one source: ``in_cluster`` (the pod's service account), ``path`` (a kubeconfig file),
    or ``secret_name`` (resolved to a kubeconfig dict by the ``secret_resolver`` callable given to
    ``KubernetesBackend.from_kubeconfig``). ``context`` picks the kubeconfig context (None = current).
    """

    path: str | None = None
    context: str | None = None
    in_cluster: bool = False
    secret_name: str | None = None

    def __post_init__(self) -> None:
        sources = sum([bool(self.path), self.in_cluster, bool(self.secret_name)])
        if sources != 1:
            raise InvalidSpec("kubeconfig reference needs exactly one of path, in_cluster, secret_name")


# Transport-level failures worth a retry: refused/reset connections, timeouts, broken streams.
_TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


class KubernetesBackend(HTTPRouteWeights, OrchestratorBackend):
    """OrchestratorBackend on one Kubernetes cluster (namespaces come from each ``PoolRef``)."""

    def __init__(self, api_client: client.ApiClient, *, max_attempts: int = 5, backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, max_conflict_retries: int = 5, request_timeout_s: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if max_attempts < 1 or max_conflict_retries < 0:
            raise ValueError("max_attempts must be >= 1 and max_conflict_retries >= 0")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {request_timeout_s}")
        self.api_client = api_client
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_conflict_retries = max_conflict_retries
        self.request_timeout_s = request_timeout_s
        self._sleep = sleep

    @classmethod
    def from_kubeconfig(
        cls,
        ref: KubeconfigRef,
        *,
        secret_resolver: Callable[[str], Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> KubernetesBackend:
        """Build the backend from a cluster's kubeconfig reference.

        Raises:
            InvalidSpec: a secret reference without a resolver, or an unusable kubeconfig.
        """
        configuration = client.Configuration()
        try:
            if ref.in_cluster:
                config.load_incluster_config(client_configuration=configuration)
            elif ref.path:
                config.load_kube_config(config_file=ref.path, context=ref.context,
                                        client_configuration=configuration)
            else:
                if secret_resolver is None:
                    raise InvalidSpec(f"kubeconfig secret {ref.secret_name!r} needs a secret_resolver")
                config.load_kube_config_from_dict(dict(secret_resolver(ref.secret_name)), context=ref.context,
                                                  client_configuration=configuration)
        except config.ConfigException as exc:
            raise InvalidSpec(f"unusable kubeconfig reference {ref}: {exc}") from exc
        return cls(cls.configure(configuration), **kwargs)

    @staticmethod
    def configure(configuration: client.Configuration) -> client.ApiClient:
        """An ApiClient with Ferry's policy: no urllib3-level retries (ours decide), lenient models.

        Client-side validation is off so that a server response missing an optional field (e.g. a
        Scale without status before the controller ran) is read instead of raising ValueError.
        """
        configuration.retries = 0
        configuration.client_side_validation = False
        return client.ApiClient(configuration)

    # -- call policy ------------------------------------------------------------------------------

    @property
    def request_timeout(self) -> tuple[float, float]:
        """``(connect_s, read_s)``: the only float form the client honours (module docstring)."""
        return (float(self.request_timeout_s), float(self.request_timeout_s))

    def _backoff_s(self, attempt: int) -> float:
        return min(self.backoff_s * (2**attempt), self.max_backoff_s)

    @property
    def call_bound_s(self) -> float:
        """Worst-case seconds of one API call with its retries against a server that stops answering:
        ``max_attempts`` attempts of at most connect + read timeout, plus the backoff between them."""
        return (self.max_attempts * 2 * self.request_timeout_s
                + sum(self._backoff_s(attempt) for attempt in range(self.max_attempts - 1)))

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one API call with backoff on 5xx/429/transport errors and typed error mapping.

        Each attempt is bounded by ``request_timeout``; the whole call by ``call_bound_s``.
        """
        kwargs.setdefault("_request_timeout", self.request_timeout)
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            try:
                return fn(*args, **kwargs)
            except client.ApiException as exc:
                if exc.status is not None and (exc.status >= 500 or exc.status == 429):
                    last = exc
                elif exc.status == 404:
                    raise NotFound(f"{fn.__name__}: {exc.reason}") from exc
                elif exc.status == 409:
                    raise Conflict(f"{fn.__name__}: {exc.reason}") from exc
                elif exc.status in (400, 422):
                    raise InvalidSpec(f"{fn.__name__} rejected by the API server: {exc.body}") from exc
                else:
                    raise BackendError(f"{fn.__name__}: HTTP {exc.status} {exc.reason}") from exc
            except _TRANSPORT_ERRORS as exc:
                last = exc
            if attempt + 1 < self.max_attempts:
                delay = self._backoff_s(attempt)
                logger.warning("kubernetes %s failed (%s); retry %d in %.2fs", fn.__name__, last, attempt + 1, delay)
                self._sleep(delay)
        raise BackendUnavailable(f"{fn.__name__} failed {self.max_attempts} times: {last}") from last

    def _retry_conflicts(self, op: Callable[[], Any]) -> Any:
        """Run ``op`` (which must re-read before writing) until it wins or the conflict budget runs out."""
        attempt = 0
        while True:
            try:
                return op()
            except Conflict:
                if attempt >= self.max_conflict_retries:
                    raise
                attempt += 1
                logger.info("kubernetes write conflicted; re-reading (retry %d)", attempt)

    # -- create or patch --------------------------------------------------------------------------

    def _create_or_patch(self, manifest: dict) -> None:
        kind = manifest["kind"]
        name = manifest["metadata"]["name"]
        namespace = manifest["metadata"]["namespace"]
        create, patch = {
            "Deployment": (self.apps.create_namespaced_deployment, self.apps.patch_namespaced_deployment),
            "Service": (self.core.create_namespaced_service, self.core.patch_namespaced_service),
            "PodDisruptionBudget": (self.policy.create_namespaced_pod_disruption_budget,
                                    self.policy.patch_namespaced_pod_disruption_budget),
            "NetworkPolicy": (self.networking.create_namespaced_network_policy,
                              self.networking.patch_namespaced_network_policy),
            "Secret": (self.core.create_namespaced_secret, self.core.patch_namespaced_secret),
        }[kind]
        try:
            self._call(create, namespace, manifest)
            return
        except Conflict:
            pass  # AlreadyExists: update it below

        def patch_once() -> None:
            self._call(patch, name, namespace, manifest)

        self._retry_conflicts(patch_once)

    def apply_pool_track(self, spec: PoolTrackSpec) -> None:
        for manifest in manifests.track_manifests(spec):
            self._create_or_patch(manifest)

    def apply_router(self, router: manifests.RouterSpec) -> None:
        """Create or update the router Deployment and Service."""
        self._create_or_patch(manifests.router_deployment_manifest(router))
        self._create_or_patch(manifests.router_service_manifest(router))

    # -- verbs ------------------------------------------------------------------------------------

    def scale_track(self, pool: PoolRef, track: str, replicas: int) -> None:
        if not isinstance(replicas, int) or replicas < 0:
            raise InvalidSpec(f"replicas must be a non-negative integer, got {replicas!r}")
        name = f"{pool.pool_name}-{track}"

        def scale_once() -> None:
            current = self._call(self.apps.read_namespaced_deployment_scale, name, pool.namespace)
            if current.spec is not None and current.spec.replicas == replicas:
                return  # already there: a duplicate delivery writes nothing
            body: dict[str, Any] = {"spec": {"replicas": replicas}}
            if current.metadata is not None and current.metadata.resource_version:
                # Optimistic concurrency: the server answers 409 if someone wrote since our read.
                body["metadata"] = {"resourceVersion": current.metadata.resource_version}
            self._call(self.apps.patch_namespaced_deployment_scale, name, pool.namespace, body)

        self._retry_conflicts(scale_once)

    def set_traffic_weights(self, pool: PoolRef, weights: Mapping[str, int]) -> str:
        validate_weights(weights)
        return ROUTING_TABLE  # Ferry's router splits traffic from the routing table, not Services

    def switch_active(self, pool: PoolRef, active_track: str) -> str:
        if active_track not in TRACKS:
            raise InvalidSpec(f"unknown track {active_track!r}")
        deployment = self._call(self.apps.read_namespaced_deployment, f"{pool.pool_name}-{active_track}",
                                pool.namespace)
        labels = deployment.metadata.labels or {}
        port = deployment.spec.template.spec.containers[0].ports[0].container_port
        role = labels.get("ferry.io/role", "colocated")
        self._create_or_patch(manifests.pool_service_manifest(pool, role, active_track, port))
        return APPLIED

    def delete_track(self, pool: PoolRef, track: str) -> None:
        """Delete the track's Deployment (foreground), Service, PDB and NetworkPolicy. Idempotent: an object that is
        gone (404) or already being deleted (a 409 while another delete updates its finalizers) counts as deleted.
        Raises ``Conflict`` for a 409 on an object that is not being deleted."""
        name, body = f"{pool.pool_name}-{track}", client.V1DeleteOptions(propagation_policy="Foreground")
        for delete, read in ((self.apps.delete_namespaced_deployment, self.apps.read_namespaced_deployment),
                             (self.core.delete_namespaced_service, self.core.read_namespaced_service),
                             (self.policy.delete_namespaced_pod_disruption_budget,
                              self.policy.read_namespaced_pod_disruption_budget),
                             (self.networking.delete_namespaced_network_policy,
                              self.networking.read_namespaced_network_policy)):
            try:
                self._call(delete, name, pool.namespace, body=body)
            except NotFound:
                pass  # already gone: deleting twice is deleting once
            except Conflict:
                try:
                    if self._call(read, name, pool.namespace).metadata.deletion_timestamp is None:
                        raise  # the Conflict: a 409 on an object nobody is deleting
                except NotFound:
                    pass  # gone since

    def restart_replica(self, pool: PoolRef, replica: str) -> None:
        pod = self._call(self.core.read_namespaced_pod, replica, pool.namespace)
        if (pod.metadata.labels or {}).get(LABEL_POOL) != pool.pool_name:
            raise NotFound(f"pod {replica!r} does not belong to pool {pool.pool_name!r}")
        # The ReplicaSet replaces a deleted pod; the grace period lets the worker drain.
        self._call(self.core.delete_namespaced_pod, replica, pool.namespace)

    def logs(self, pool: PoolRef, replica: str, tail: int = 100) -> str:
        if tail < 1:
            raise InvalidSpec(f"tail must be >= 1, got {tail}")
        text = self._call(self.core.read_namespaced_pod_log, replica, pool.namespace,
                          container=manifests.CONTAINER_NAME, tail_lines=tail, limit_bytes=4 * MAX_LOG_BYTES)
        return log_text(text.encode("utf-8", errors="replace"))

    def observe(self, pool: PoolRef) -> ObservedState:
        selector = f"{LABEL_POOL}={pool.pool_name}"
        deployments = self._call(self.apps.list_namespaced_deployment, pool.namespace, label_selector=selector)
        pods = self._call(self.core.list_namespaced_pod, pool.namespace, label_selector=selector)
        replicas_by_track: dict[str, list[ObservedReplica]] = {}
        for pod in pods.items:
            labels = pod.metadata.labels or {}
            track = labels.get(LABEL_TRACK)
            if labels.get(LABEL_POOL) != pool.pool_name or track is None or pod.metadata.deletion_timestamp:
                continue
            replicas_by_track.setdefault(track, []).append(_observed_replica(pod, track))
        tracks: dict[str, ObservedTrack] = {}
        for deployment in deployments.items:
            labels = deployment.metadata.labels or {}
            track = labels.get(LABEL_TRACK)
            if labels.get(LABEL_POOL) != pool.pool_name or track is None or deployment.metadata.deletion_timestamp:
                continue  # a Deployment being deleted is going away (delete_track): not a track, as its pods
            status = deployment.status
            tracks[track] = ObservedTrack(
                track=track,
                desired_replicas=deployment.spec.replicas or 0,
                ready_replicas=(status.ready_replicas or 0) if status is not None else 0,
                replicas=tuple(sorted(replicas_by_track.get(track, []), key=lambda r: r.name)),
            )
        return ObservedState(pool_name=pool.pool_name, tracks=tracks, active_track=self._active_track(pool))

    def _active_track(self, pool: PoolRef) -> str | None:
        try:
            service = self._call(self.core.read_namespaced_service, pool.pool_name, pool.namespace)
        except NotFound:
            return None
        return (service.spec.selector or {}).get(LABEL_TRACK)

    # -- watch ------------------------------------------------------------------------------------

    def watch_deployments(
        self, namespace: str, label_selector: str, *, timeout_s: float, watch_timeout_s: int = 30,
    ) -> Iterator[tuple[str, Any]]:
        """Yield ``("LIST", [deployments])`` after every (re-)list, then ``(event_type, deployment)``.

        Each watch request carries ``timeoutSeconds`` (whole seconds, what the API server takes) and a
        client read timeout that ends at ``timeout_s`` plus a grace of ``min(1, request_timeout_s)``,
        so a silent server cannot hang us; when a watch ends it is reopened from the last
        resourceVersion. A 410 Gone (expired resourceVersion) triggers a fresh list. Consecutive 410s,
        broken streams and streams the server closes early without an event back off like ``_call`` (``backoff_s * 2**n``, capped at ``max_backoff_s``,
        never past the deadline); an event resets the count. Stops after ``timeout_s`` seconds in
        total, plus the grace, plus at most one list (``call_bound_s``) against a stalled server.

        Raises:
            BackendUnavailable: the list failed after backoff, or the watch answered an HTTP error
                other than 410.
        """
        deadline = time.monotonic() + timeout_s
        grace_s = min(1.0, self.request_timeout_s)
        resource_version: str | None = None
        failures = 0
        while time.monotonic() < deadline:
            if resource_version is None:
                listing = self._call(self.apps.list_namespaced_deployment, namespace, label_selector=label_selector)
                resource_version = listing.metadata.resource_version if listing.metadata else None
                yield "LIST", listing.items
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return
            watcher = watch.Watch()
            kwargs: dict[str, Any] = {
                "label_selector": label_selector,
                "timeout_seconds": max(1, min(watch_timeout_s, math.ceil(remaining_s))),
                "_request_timeout": (float(self.request_timeout_s), remaining_s + grace_s),
            }
            if resource_version:
                kwargs["resource_version"] = resource_version
            opened = time.monotonic()
            events = 0
            try:
                for event in watcher.stream(self.apps.list_namespaced_deployment, namespace, **kwargs):
                    failures, events = 0, events + 1
                    yield event["type"], event["object"]
                    if watcher.resource_version:
                        resource_version = watcher.resource_version
                    if time.monotonic() >= deadline:
                        return
                if events or time.monotonic() - opened >= kwargs["timeout_seconds"] / 2:
                    continue  # the server closed the watch at timeoutSeconds: reopen at once
                logger.info("watch of deployments closed early without events; reopening after backoff")
            except client.ApiException as exc:
                if exc.status != 410:
                    raise BackendUnavailable(f"watch of deployments failed: HTTP {exc.status}") from exc
                logger.info("watch resourceVersion %s expired (410 Gone); re-listing", resource_version)
                resource_version = None  # re-list
            except _TRANSPORT_ERRORS as exc:
                logger.info("watch of deployments ended (%s); reopening", type(exc).__name__)
            finally:
                watcher.stop()
            delay = min(self._backoff_s(failures), max(0.0, deadline - time.monotonic()))
            failures += 1
            if delay > 0:
                self._sleep(delay)

    def wait_track_ready(self, pool: PoolRef, track: str, replicas: int, *, timeout_s: float) -> bool:
        """Block until the track's Deployment reports ``readyReplicas == replicas``; False on timeout."""
        name = f"{pool.pool_name}-{track}"
        selector = f"{LABEL_POOL}={pool.pool_name},{LABEL_TRACK}={track}"
        for kind, payload in self.watch_deployments(pool.namespace, selector, timeout_s=timeout_s):
            items = payload if kind == "LIST" else [payload]
            for deployment in items:
                if deployment.metadata.name != name or kind == "DELETED":
                    continue
                ready = (deployment.status.ready_replicas or 0) if deployment.status is not None else 0
                if ready == replicas and deployment.spec.replicas == replicas:
                    return True
        return False


def _observed_replica(pod: Any, track: str) -> ObservedReplica:
    labels = pod.metadata.labels or {}
    status = pod.status
    conditions = (status.conditions or []) if status is not None else []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    container_statuses = (status.container_statuses or []) if status is not None else []
    restarts = sum(cs.restart_count or 0 for cs in container_statuses)
    exit_code = exited_at = None
    message = ""
    for cs in container_statuses:
        # A container that died and waits to be restarted (CrashLoopBackOff) has its death in
        # last_state; one that died for good (restartPolicy Never) in state.
        terminated = next((t for t in (cs.state.terminated if cs.state is not None else None,
                                       cs.last_state.terminated if cs.last_state is not None else None)
                           if t is not None), None)
        if terminated is not None:
            exit_code = terminated.exit_code
            message = (terminated.message or "").strip()
            finished = terminated.finished_at
            exited_at = finished.timestamp() if hasattr(finished, "timestamp") else None
    # The worker's HTTP endpoint is the port named "http" (a decode worker also exposes its "kv" port).
    port = 8000
    for container in pod.spec.containers if pod.spec is not None else []:
        for container_port in container.ports or []:
            if container_port.name in ("http", None):
                port = container_port.container_port
    pod_ip = status.pod_ip if status is not None else None
    return ObservedReplica(
        name=pod.metadata.name,
        track=track,
        endpoint=f"http://{pod_ip}:{port}" if pod_ip else "",
        ready=ready,
        alive=(status.phase == "Running") if status is not None else False,
        version=labels.get(LABEL_MODEL_VERSION, ""),
        restart_count=restarts,
        exit_code=exit_code,
        exited_at=exited_at,
        message=message,
    )
