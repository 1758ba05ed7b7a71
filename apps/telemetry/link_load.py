"""Link load: each cluster link's measured KV traffic (Gbit/s) and utilisation, for bandwidth-aware routing.

Source: the decode side's KV-transfer counter, ``ferry_kv_transfer_wire_bytes_total{direction="receive"}``
(bytes on the wire, compressed and framed: what the link carries), as the per-pool rate the poller already
computes (``kv_transfers``' ``wire_bytes_per_s``, Prometheus ``rate()`` math over the poller's window).
Workers label their KV series with their own pool only, not the peer's, so the bytes a decode (or colocated)
pool in datacenter ``T`` receives are attributed to the datacenters that hold a prefill pool of one of its
model versions (KV is only valid between replicas of the same weights), in equal shares when there are
several; the share of a prefill pool in ``T`` itself crosses no link. With one prefill datacenter per model
version (Ferry's PD layout) the attribution is exact.

Per link: Ethernet is full duplex, so the two directions do not share bandwidth and a link's utilisation is
that of its busier direction: ``kv_gbps = max(flow(a -> b), flow(b -> a)) * 8 / 1e9`` and
``utilisation = kv_gbps / bandwidth_gbps`` (not clamped here: above 1 shows a link's nominal bandwidth is
wrong; the router reads it as saturated).

The document (``{"at", "window_s", "links": [{"source", "target", "bandwidth_gbps", "kv_gbps",
"utilisation"}]}``, datacenter names as in the routing table's ``links``) is stored every poll for the
routers (:func:`apps.fleet.routing_table_cache.link_load_store`, why it is not in the table is said there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from apps.fleet.models import ClusterLink, Pool
from apps.fleet.routing_table import datacenter_of

RECEIVE = "receive"
PD_RECEIVING_ROLES = ("decode", "colocated")


@dataclass(frozen=True)
class PoolPlacement:
    """Where a pool runs and what it serves."""

    pool_id: int
    role: str
    datacenter: str
    model_versions: frozenset[str]


@dataclass(frozen=True)
class LinkSpec:
    """A cluster link by datacenter names."""

    source: str
    target: str
    bandwidth_gbps: float


def link_flows(pools: Sequence[PoolPlacement], receive_bytes_per_s: Mapping[int, float]) -> dict[tuple[str, str], float]:
    """KV bytes/s per (source datacenter, target datacenter) pair, ``source != target`` (module docstring).

    Args:
        pools: every pool (prefill pools place the sources).
        receive_bytes_per_s: pool id -> the pool's received KV wire bytes/s (pools without a rate are skipped).
    """
    flows: dict[tuple[str, str], float] = {}
    for pool in pools:
        rate = receive_bytes_per_s.get(pool.pool_id)
        if pool.role not in PD_RECEIVING_ROLES or not rate:
            continue
        sources = sorted({p.datacenter for p in pools if p.role == Pool.Role.PREFILL
                          and p.model_versions & pool.model_versions})
        for source in sources:
            if source != pool.datacenter:
                key = (source, pool.datacenter)
                flows[key] = flows.get(key, 0.0) + rate / len(sources)
    return flows


def link_load(links: Iterable[LinkSpec], flows: Mapping[tuple[str, str], float]) -> list[dict]:
    """Per link: ``{"source", "target", "bandwidth_gbps", "kv_gbps", "utilisation"}`` from ``flows`` (bytes/s per
    directed datacenter pair): the busier direction's Gbit/s and its share of ``bandwidth_gbps``."""
    out = []
    for link in links:
        busier = max(flows.get((link.source, link.target), 0.0), flows.get((link.target, link.source), 0.0))
        gbps = busier * 8 / 1e9
        out.append({"source": link.source, "target": link.target, "bandwidth_gbps": link.bandwidth_gbps,
                    "kv_gbps": gbps, "utilisation": gbps / link.bandwidth_gbps if link.bandwidth_gbps > 0 else 0.0})
    return out


def placements() -> list[PoolPlacement]:
    """Every pool's role, datacenter and model versions (stable and tracks): 2 queries."""
    pools = Pool.objects.select_related("cluster").prefetch_related("tracks__model_version")
    return [PoolPlacement(p.pk, p.role, datacenter_of(p.cluster),
                          frozenset({t.model_version.version for t in p.tracks.all()}))
            for p in pools]


def link_specs() -> list[LinkSpec]:
    """Every cluster link by datacenter names (1 query)."""
    return [LinkSpec(datacenter_of(x.source), datacenter_of(x.destination), x.bandwidth_gbps)
            for x in ClusterLink.objects.select_related("source", "destination").order_by("id")]


def link_load_document(records: Mapping[int, dict], *, at_s: float, window_s: float) -> dict:
    """The link-load document from one poll's pool records (pool id -> record with ``kv_transfers``)."""
    links = link_specs()
    if not links:  # nothing to measure: skip the pools' query
        return {"at": at_s, "window_s": window_s, "links": []}
    receive = {pool_id: record["kv_transfers"].get("wire_bytes_per_s", {}).get(RECEIVE, 0.0)
               for pool_id, record in records.items() if record.get("kv_transfers")}
    return {"at": at_s, "window_s": window_s, "links": link_load(links, link_flows(placements(), receive))}
