"""The routing table's content, built from pools, tracks, observed ready replicas, links and model versions.

The shape is the router's (``inference_worker.router.table``, module docstring); this module builds it
without the ``version`` (the publish service numbers it). Rules:

* ``tracks`` (the traffic split, per served model): for each model name, the tracks of its first
  decode/colocated pool (lowest id), each with its model version and its weight (0 when a blue-green
  track is not active). Weights that do not sum to 100 are rescaled by the largest remainder method;
  all zero gives ``stable`` (or the first track) 100. With no pools: ``stable`` at 100 with an empty
  model version.
* ``pools``: every pool with its role, its cluster's datacenter (or the cluster name), its worker token
  (``worker_token``, and ``worker_token_previous`` during a rotation: the router sends it to the pool's
  replicas; only the service token's readers get them, :func:`content_redacted`) and its replicas that are
  alive, ready and have an endpoint (the router must not pick a starting one), and its remote-prefill threshold
  bounds (``remote_threshold_min_tokens`` / ``remote_threshold_max_tokens``, each only when set).
* ``links``: cluster links by datacenter (their measured utilisation is not here: it changes every second, and
  a new version every second would send every router the whole table; telemetry serves it beside the table,
  ``GET /api/v1/link-load/``, :mod:`apps.fleet.routing_table_cache`); ``models``: per model version in use, its KV layout and what the
  router needs to route by ``model`` and hash prompts like the workers (:func:`model_entry`);
  ``length_routing``: ``FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS`` when set.
* ``client_keys``: the active client API keys as ``{"name", "key_sha256", "rate_per_s", "burst"}`` (and
  ``"models"`` for a key limited to some models): hashes only, built by
  :func:`apps.accounts.selectors.client_keys_routed`. Routers that get a table with ``client_keys`` accept
  these keys (and their own file's, if configured).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from apps.catalog.models import ModelVersion
from apps.fleet.models import ClusterLink, Pool, PoolTrack
from inference_worker.config import DTYPE_BYTES
from inference_worker.router.table import BOUND_FIELDS  # the pool fields the router reads (one spelling)

ROUTING_ROLES = ("decode", "colocated")
"""The pool's threshold bounds, under the same names in the model, the API and the table."""


def normalize_weights(weights: Sequence[tuple[str, int]]) -> dict[str, int]:
    """Integer percents summing to exactly 100, proportional to ``weights`` (largest remainder).

    All-zero weights give 100 to ``stable`` if present, else to the first track.

    Raises:
        ValueError: no tracks, or a negative weight.
    """
    if not weights:
        raise ValueError("at least one track is needed")
    if any(w < 0 for _, w in weights):
        raise ValueError(f"weights must be >= 0, got {list(weights)}")
    total = sum(w for _, w in weights)
    if total == 0:
        names = [n for n, _ in weights]
        winner = "stable" if "stable" in names else names[0]
        return {n: (100 if n == winner else 0) for n in names}
    exact = [(n, 100 * w / total) for n, w in weights]
    parts = {n: int(x) for n, x in exact}
    order = sorted(exact, key=lambda item: (-(item[1] - int(item[1])), item[0]))
    for name, _ in order[: 100 - sum(parts.values())]:
        parts[name] += 1
    return parts


def datacenter_of(cluster) -> str:  # noqa: ANN001 - a Cluster
    return cluster.datacenter or cluster.name


def kv_layout(version: ModelVersion) -> dict:
    """``KVLayout.from_dict`` input for a model version (the cache dtype: the model's, else float16)."""
    return {
        "layer_types": list(version.layer_types),
        "sliding_window": version.sliding_window or 0,
        "num_kv_heads": version.num_key_value_heads,
        "head_dim": version.head_dim,
        "dtype": version.dtype if version.dtype in DTYPE_BYTES else "float16",
    }


DEFAULT_BLOCK_SIZE = 16
"""The worker's default ``--block-size``."""


def model_entry(version: ModelVersion) -> dict:
    """The routing table's ``models`` entry of a version: :func:`kv_layout` plus the OpenAI model name, the
    tokenizer reference (the built-in model name, which the router finds in its model cache) and the digest
    salt inputs (``block_hash.prefix_root``): the version's weights sha256, its KV dtype and the block size.

    The salt is what the control plane knows: a worker that loads other bytes (a re-prepared artifact) or
    another dtype hashes differently; the router's ``ferry_router_predicted_cached_tokens_total`` against the
    reported total shows it.
    """
    layout = kv_layout(version)
    return {**layout, "model": version.name, "tokenizer": version.name, "weights_sha256": version.sha256,
            "kv_dtype": layout["dtype"], "block_size": DEFAULT_BLOCK_SIZE}


def _model_tracks(pools: Sequence[Pool]) -> list[dict]:
    reference = next((p for p in pools if p.role in ROUTING_ROLES and p.tracks.all()), None)
    if reference is None:
        reference = next((p for p in pools if p.tracks.all()), None)
    if reference is None:
        return [{"name": PoolTrack.Name.STABLE.value, "model_version": "", "weight": 100}]
    tracks = list(reference.tracks.all())
    weights = normalize_weights([(t.name, t.weight if t.active else 0) for t in tracks])
    return [{"name": t.name, "model_version": t.model_version.version, "weight": weights[t.name]} for t in tracks]


def _traffic_tracks(pools: Sequence[Pool]) -> list[dict]:
    """Tracks of every served model (pools grouped by their tracks' model name, in pool order)."""
    by_model: dict[str, list[Pool]] = {}
    for pool in pools:
        names = {t.model_version.name for t in pool.tracks.all()}
        for name in sorted(names) or [""]:
            by_model.setdefault(name, []).append(pool)
    tracks = [t for group in by_model.values() for t in _model_tracks(group)]
    return tracks or _model_tracks([])


def routing_table_content(pools: Sequence[Pool], links: Iterable[ClusterLink], *,
                          threshold_tokens: int | None = None, client_keys: list[dict] | None = None) -> dict:
    """The routing table without ``version`` (see the module docstring).

    ``pools`` come from ``selectors.routing_pools()`` (tracks prefetched, ``ready_replicas`` attached);
    ``client_keys``: the ``client_keys`` entries (None: the table carries none).
    """
    models: dict[str, dict] = {}
    table_pools = []
    for pool in pools:
        track_versions = {}
        for track in pool.tracks.all():
            track_versions[track.name] = track.model_version.version
            if track.model_version.version not in models:  # the first version of that name, as setdefault kept
                models[track.model_version.version] = model_entry(track.model_version)
        replicas = [
            {"name": r.name, "url": r.endpoint.rstrip("/"), "track": r.track,
             "model_version": r.version or track_versions.get(r.track, "")}
            for r in getattr(pool, "ready_replicas", [])
        ]
        entry = {"name": pool.name, "role": pool.role, "datacenter": datacenter_of(pool.cluster),
                 "worker_token": pool.worker_token, "replicas": replicas}
        if pool.worker_token_previous:
            entry["worker_token_previous"] = pool.worker_token_previous
        for bound in BOUND_FIELDS:  # absent when unset: tables of pools without bounds stay as they were
            if getattr(pool, bound) is not None:
                entry[bound] = getattr(pool, bound)
        if pool.engine != Pool.Engine.FERRY:
            entry["engine"] = pool.engine  # absent for Ferry pools: older routers read the table unchanged
        table_pools.append(entry)
    content = {
        "tracks": _traffic_tracks(pools),
        "pools": table_pools,
        "links": [{"source": datacenter_of(link.source), "target": datacenter_of(link.destination),
                   "bandwidth_gbps": link.bandwidth_gbps, "rtt_ms": link.rtt_ms} for link in links],
        "models": models,
    }
    if threshold_tokens is not None:
        content["length_routing"] = {"threshold_tokens": threshold_tokens}
    if client_keys is not None:
        content["client_keys"] = client_keys
    return content


WORKER_TOKEN_FIELDS = ("worker_token", "worker_token_previous")


def content_redacted(content: dict) -> dict:
    """``content`` without the pools' worker tokens and the client keys' names and hashes: what a reader of the
    table who is not a router (a viewer, a page) may see. The service token's readers (routers) get the whole table."""
    pools = [{k: v for k, v in pool.items() if k not in WORKER_TOKEN_FIELDS} for pool in content.get("pools", ())]
    return {**{k: v for k, v in content.items() if k != "client_keys"}, "pools": pools}


def content_digest(content: dict) -> str:
    """sha256 (hex) of the canonical JSON of ``content`` (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
