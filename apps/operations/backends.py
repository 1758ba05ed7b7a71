"""From Django rows to orchestrator backends: the backend of a cluster and the spec of a pool track.

The orchestrator package knows nothing of Django; this module is the one translation point:

* :func:`backend_for_cluster` picks the backend by ``Cluster.kind`` — ``local``: the local agent at
  ``cluster.agent_url`` with ``settings.FERRY_AGENT_TOKEN``; ``kubernetes``: the official client
  configured from the cluster's kubeconfig reference (file path + context, or in-cluster).
* :func:`track_spec` builds a :class:`PoolTrackSpec` from a pool, one of its tracks and the track's
  model version (image, weights URI + sha256 for the init step, resources, placement, drain timeout).

Worker process settings shared by every pool come from settings: ``FERRY_WORKER_ENV`` (a dict of
environment variables) and ``FERRY_WORKER_EXTRA_ARGS`` (arguments appended to ``serve``). A track's own
``PoolTrack.extra_args`` (e.g. a canary's ``--fault-error-rate 0.5``) come after the global ones, so
argparse's last-value rule lets a track override a global option.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

from django.conf import settings

from apps.catalog.models import ModelVersion
from apps.fleet.models import Cluster, ClusterLink, Pool, PoolTrack
from apps.fleet.worker_args import InvalidWorkerArgs, parse_worker_args
from apps.orchestrators.base import (
    InvalidSpec,
    ModelRef,
    OrchestratorBackend,
    PoolRef,
    PoolTrackSpec,
    Resources,
    Toleration,
)

DEFAULT_IMAGE = "ferry/inference-worker:latest"
KUBERNETES_KV_PORT = 8001
"""Decode workers' KV receiver port on Kubernetes (a fixed port the pool's NetworkPolicy opens)."""
FETCHABLE_SCHEMES = ("http", "https", "file")  # what the Kubernetes init step can download


def worker_env() -> dict[str, str]:
    """``FERRY_WORKER_ENV`` (JSON object in the environment or a dict setting) as str -> str.

    Raises:
        InvalidSpec: the value is not a JSON object of strings.
    """
    raw = getattr(settings, "FERRY_WORKER_ENV", None) or os.environ.get("FERRY_WORKER_ENV", "")
    if not raw:
        return {}
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        raise InvalidSpec(f"FERRY_WORKER_ENV is not JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidSpec('FERRY_WORKER_ENV must be a JSON object of strings, e.g. {"OMP_NUM_THREADS": "1"}')
    return value


def worker_extra_args() -> tuple[str, ...]:
    """``FERRY_WORKER_EXTRA_ARGS`` split like a shell line, e.g. ``--max-num-seqs 8``."""
    raw = getattr(settings, "FERRY_WORKER_EXTRA_ARGS", None) or os.environ.get("FERRY_WORKER_EXTRA_ARGS", "")
    return tuple(shlex.split(raw)) if isinstance(raw, str) else tuple(raw)


def pool_ref(pool: Pool) -> PoolRef:
    """The backend's handle of ``pool`` (namespace from a Kubernetes cluster, else ``default``).

    Raises:
        InvalidSpec: the pool name is longer than 40 characters (object names derive from it).
    """
    return PoolRef(pool_id=pool.pk, pool_name=pool.name, namespace=pool.cluster.namespace or "default")


def model_ref(version: ModelVersion, *, local: bool = False) -> ModelRef:
    """The worker's view of a model version; weights URIs the init step cannot fetch are left to the image.

    ``local``: the track runs on this host (a ``local`` cluster), so a ``file://`` weights URI naming an
    existing path is loaded from there (``ModelRef.local_path``) instead of by the model's name — otherwise
    every version of a model would load the same built-in artifact whatever its ``sha256``.
    """
    parts = urlsplit(version.weights_uri)
    fetchable = parts.scheme in FETCHABLE_SCHEMES
    local_path = ""
    if local and parts.scheme == "file" and Path(unquote(parts.path)).exists():
        local_path = unquote(parts.path)
    return ModelRef(
        name=version.name, version=version.version, image=version.container_image or DEFAULT_IMAGE,
        weights_uri=version.weights_uri if fetchable else "", sha256=version.sha256 if fetchable else "",
        local_path=local_path,
    )


def track_spec(pool: Pool, track: PoolTrack) -> PoolTrackSpec:
    """Everything a backend needs to run ``track`` of ``pool`` at ``track.replicas`` replicas.

    ``drain_timeout_s`` is clamped to the backend's 1..3600 s. ``extra_args``: ``FERRY_WORKER_EXTRA_ARGS``
    then the track's ``extra_args`` (re-checked with the worker's parser). The pool's worker token (and the
    previous one during a rotation) travels in ``worker_token``, which each backend puts in the workers'
    environment, never in their arguments; a ``FERRY_WORKER_ENV`` that sets it is refused. On Kubernetes decode pools receive KV
    on :data:`KUBERNETES_KV_PORT`, and ``kv_peer_cidrs`` are the ``source_cidrs`` of the links into the pool's
    cluster (the track's NetworkPolicy admits them).

    Raises:
        InvalidSpec: a field the backend cannot express (name too long, bad toleration, worker
            arguments the worker would refuse, ...).
    """
    if pool.engine != Pool.Engine.FERRY:
        # worker_args and FERRY_WORKER_EXTRA_ARGS are Ferry worker options (an allowlist of its CLI); an engine's
        # own options are not taken from operators (the allowlist would not cover them).
        if track.extra_args.strip():
            raise InvalidSpec(f"worker_args are Ferry worker options; pool {pool.name!r} runs {pool.engine}, whose "
                              "options cannot be set through worker_args")
        extra_args: list[str] = []
    else:
        try:
            extra_args = worker_extra_args() + parse_worker_args(track.extra_args,
                                                                 faults_allowed=not pool.cluster.production)
        except InvalidWorkerArgs as exc:
            raise InvalidSpec(str(exc)) from exc
    tolerations = tuple(
        Toleration(key=t.get("key", ""), operator=t.get("operator", "Equal"), value=t.get("value") or None,
                   effect=t.get("effect") or None)
        for t in pool.tolerations
    )
    kubernetes = pool.cluster.kind == Cluster.Kind.KUBERNETES
    peer_cidrs: tuple[str, ...] = ()
    if kubernetes:
        links = ClusterLink.objects.filter(destination_id=pool.cluster_id).order_by("source__name")
        peer_cidrs = tuple(dict.fromkeys(cidr for link in links for cidr in link.source_cidrs))
    return PoolTrackSpec(
        kv_port=KUBERNETES_KV_PORT if kubernetes and pool.role == Pool.Role.DECODE else None,
        kv_peer_cidrs=peer_cidrs,
        pool=pool_ref(pool), role=pool.role, track=track.name, model=model_ref(track.model_version, local=pool.cluster.kind == "local"),
        replicas=track.replicas, extra_args=extra_args,
        env=worker_env(),
        resources=Resources(gpu_count=pool.gpu_count, cpu=pool.cpu or None, memory=pool.memory or None),
        node_selector=dict(pool.node_selector), tolerations=tolerations,
        drain_timeout_s=min(max(pool.drain_timeout_s, 1), 3600),
        engine=pool.engine,
        worker_token=pool.worker_token, worker_token_previous=pool.worker_token_previous,
    )


def backend_for_cluster(cluster: Cluster) -> OrchestratorBackend:
    """A new backend for ``cluster`` (close it with :func:`close_backend`, or use :func:`backend_session`).

    Raises:
        InvalidSpec: an unknown kind, a local cluster without agent URL/token, or a Kubernetes
            cluster whose kubeconfig reference cannot be used (a Secret reference has no resolver yet).
    """
    # Backends are imported on first use, not to dodge a cycle: the Kubernetes client takes ~0.18 s to
    # import (httpx ~0.07 s) and a process that never talks to that kind of cluster should not pay it.
    if cluster.kind == Cluster.Kind.LOCAL:
        from apps.orchestrators.local_backend import LocalAgentBackend

        token = getattr(settings, "FERRY_AGENT_TOKEN", "") or os.environ.get("FERRY_AGENT_TOKEN", "")
        if not cluster.agent_url or not token:
            raise InvalidSpec(f"local cluster {cluster.name!r} needs agent_url and FERRY_AGENT_TOKEN")
        return LocalAgentBackend(cluster.agent_url, token)
    if cluster.kind == Cluster.Kind.KUBERNETES:
        from apps.orchestrators.kubernetes_backend import KubeconfigRef, KubernetesBackend

        ref = KubeconfigRef(path=cluster.kubeconfig_path or None, context=cluster.context or None,
                            in_cluster=cluster.in_cluster, secret_name=cluster.kubeconfig_secret or None)
        return KubernetesBackend.from_kubeconfig(ref)
    raise InvalidSpec(f"cluster {cluster.name!r} has unknown kind {cluster.kind!r}")


def close_backend(backend: OrchestratorBackend) -> None:
    """Release the backend's connections (HTTP client or Kubernetes ApiClient)."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()
        return
    api_client = getattr(backend, "api_client", None)
    if api_client is not None:
        api_client.close()


@contextmanager
def backend_session(cluster: Cluster) -> Iterator[OrchestratorBackend]:
    """``with backend_session(cluster) as backend:`` — the backend, closed afterwards."""
    backend = backend_for_cluster(cluster)
    try:
        yield backend
    finally:
        close_backend(backend)
