"""The routing table: the versioned description of where the router may send traffic (torch-free).

JSON shape (served by the control plane at ``GET /api/v1/routing-table/`` or kept in a file)::

    {
      "version": 12,                                   # increases with every change
      "tracks": [                                      # the traffic split; weights are % summing to 100
        {"name": "stable", "model_version": "v1", "weight": 90},
        {"name": "canary", "model_version": "v2", "weight": 10}
      ],
      "pools": [
        {"name": "decode-dc1", "role": "decode", "datacenter": "dc1",       # role: decode|colocated|prefill
         "worker_token": "<secret>",          # optional: sent as Authorization: Bearer to its replicas;
         "worker_token_previous": "<secret>", # optional: tried on a 401 while a rotation rolls the replicas
         "replicas": [{"name": "decode-dc1-0", "url": "http://10.0.0.5:8000", "track": "stable",
                       "model_version": "v1"}]},                             # model_version: default = track's
        {"name": "prefill-dc2", "role": "prefill", "datacenter": "dc2", "replicas": [...]},
        {"name": "chat-vllm", "role": "colocated", "engine": "vllm", "replicas": [...]}  # engine: ferry (default)
                                                        # | vllm | sglang (inference_worker.engine_kinds)
      ],
      "links": [{"source": "dc2", "target": "dc1", "bandwidth_gbps": 10, "rtt_ms": 20,
                 "utilisation": 0.25}],                 # optional: measured share in use, 0..1 (see below)
      "length_routing": {"threshold_tokens": 2048},    # fixed threshold, or derived:
      # "length_routing": {"decode_prefill_tokens_per_s": 4000, "max_tokens": 131072},
      "models": {"v1": {"layer_types": [...], "sliding_window": 512, "num_kv_heads": 1, "head_dim": 256,
                        "dtype": "bfloat16",            # KV layout per model version (PD cost function)
                        # optional, for many models and cache-aware routing (absent in older tables):
                        "model": "gemma-3-270m",        # the OpenAI ``model`` clients send for this version
                        "tokenizer": "gemma-3-270m",    # tokenizer reference: a directory, file:// URI or
                                                        # built-in model name (in the router's model cache)
                        "weights_sha256": "<64 hex>", "kv_dtype": "float32", "block_size": 16}},  # digest salt
      "client_keys": [{"name": "team-a", "key_sha256": "<64 hex>", "rate_per_s": 5, "burst": 10,  # optional
                       "models": ["gemma-3-270m"]}]    # models: optional, absent = every model
    }

``client_keys`` (optional) are the client API keys the control plane manages, as SHA-256 digests only
(:mod:`.auth`): a table that carries the list (even empty) is the authority for those keys, and the router
accepts them besides its own ``--api-keys`` file; a table without it leaves the router with its file's keys.

Pools may also carry ``"routing_weights": {"hit": 2.0, "waiting": 512, ...}`` (scoring weights, see
:mod:`.scoring`), ``"remote_threshold_min_tokens"`` / ``"remote_threshold_max_tokens"`` (the operator's bounds
on a decode pool's effective remote-prefill threshold, integers >= 0, min <= max; :mod:`.pipeline`) and ``length_routing`` may carry ``prefill_tokens_per_s`` (the prefill pool's speed).
The PD decision (local or remote prefill) is :mod:`.pd_cost`'s cost function; ``threshold_tokens`` is an
operator override applied to the prompt's *uncached* tokens.

**Link load**: a link's ``utilisation`` is the share of its bandwidth the KV hand-offs use (telemetry's
measurement, :mod:`apps.telemetry.link_load`), fed to the cost function as ``link_share_used``. The control
plane does not put it in the versioned table (a value that changes every second would publish a new version
every second to every router); it serves it as a small separate document, ``GET /api/v1/link-load/``, which
:class:`.source.LinkLoadSource` polls and :meth:`RoutingTable.with_link_utilisation` lays over the table. A
table read from a file may carry it inline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from inference_worker.engine_kinds import ENGINE_KINDS, FERRY
from inference_worker.kv_transfer.layout import KVLayout
from inference_worker.router.auth import KeySpec
from inference_worker.router.pd_cost import PDProfile
from inference_worker.router.pd_cost import derived_threshold as _derived_threshold
from inference_worker.router.scoring import ScoringWeights

ROLES = ("decode", "colocated", "prefill")
DECODE_ROLES = ("decode", "colocated")


class RoutingTableError(ValueError):
    """The routing table is malformed; the message names the offending field."""


@dataclass(frozen=True)
class Replica:
    """One worker the router can reach."""

    name: str
    url: str
    """Base URL of its OpenAI-compatible HTTP API, e.g. ``http://10.0.0.5:8000``."""
    pool: str
    role: str
    track: str
    model_version: str
    datacenter: str = ""
    engine: str = FERRY
    """The pool's engine kind (:mod:`inference_worker.engine_kinds`): how its ``/metrics`` names read."""
    worker_token: str = field(default="", repr=False)
    """Its pool's worker token, sent as ``Authorization: Bearer`` on every call to it ("" = none: an open worker)."""
    worker_token_previous: str = field(default="", repr=False)
    """The pool's token before its last rotation: tried once when the replica answers 401 to ``worker_token`` (it
    has not rolled to the new token yet)."""

    @property
    def auth_headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer <worker_token>"}``, or ``{}`` for a pool without a token."""
        return {"Authorization": f"Bearer {self.worker_token}"} if self.worker_token else {}


@dataclass(frozen=True)
class ModelInfo:
    """Per model version: what the router needs to route by ``model`` and to hash prompts like the workers."""

    model: str = ""
    """The OpenAI ``model`` name of this version ("" in older tables: any request model matches)."""
    tokenizer: str = ""
    """Tokenizer reference (directory, ``file://`` URI or built-in model name); "" = none (no cache scoring)."""
    weights_sha256: str = ""
    kv_dtype: str = ""
    block_size: int = 16
    """Digest salt inputs (``block_hash.prefix_root``); cache scoring needs all three."""

    @property
    def can_hash(self) -> bool:
        """True when prompts can be hashed exactly like the workers do."""
        return bool(self.tokenizer and self.weights_sha256 and self.kv_dtype and self.block_size >= 1)


@dataclass(frozen=True)
class Track:
    """A share of traffic bound to one model version."""

    name: str
    model_version: str
    weight: float
    """Percent of requests (all tracks sum to 100)."""


@dataclass(frozen=True)
class Link:
    """Network between two datacenters."""

    source: str
    target: str
    bandwidth_gbps: float
    rtt_ms: float = 0.0
    utilisation: float = 0.0
    """Measured share of ``bandwidth_gbps`` in use, in [0, 1] (a measurement above 1 is read as 1: saturated)."""


@dataclass(frozen=True)
class ThresholdBounds:
    """A decode pool's bounds on its effective remote-prefill threshold, in uncached prompt tokens (None: unbounded)."""

    min_tokens: int | None = None
    """Prompts with at most this many uncached tokens always prefill locally."""
    max_tokens: int | None = None
    """Prompts with more uncached tokens than this always prefill remotely (when a prefill replica exists)."""

    def clamp(self, threshold: float) -> float:
        """``threshold`` (tokens, may be ``-1`` or ``inf``) clamped into ``[min_tokens, max_tokens]``."""
        if self.min_tokens is not None:
            threshold = max(threshold, self.min_tokens)
        if self.max_tokens is not None:
            threshold = min(threshold, self.max_tokens)
        return threshold


@dataclass(frozen=True)
class RoutingTable:
    """A parsed, validated routing table (see the module docstring for the JSON)."""

    version: int
    tracks: tuple[Track, ...]
    replicas: tuple[Replica, ...]
    links: tuple[Link, ...] = ()
    threshold_tokens: int | None = None
    """Fixed remote-prefill threshold (None: derived, or never remote when it cannot be derived)."""
    decode_prefill_tokens_per_s: float | None = None
    max_tokens: int = 131072
    models: dict[str, KVLayout] = field(default_factory=dict)
    model_info: dict[str, ModelInfo] = field(default_factory=dict)
    """Per model version (every version named by a track or replica has one; defaults when not in ``models``)."""
    pool_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per pool name: scoring weight overrides (``routing_weights``)."""
    prefill_tokens_per_s: float | None = None
    client_keys: tuple[KeySpec, ...] | None = None
    """The control plane's client API keys (None: the table carries none; :mod:`.auth`)."""
    pool_bounds: dict[str, ThresholdBounds] = field(default_factory=dict)
    """Per pool name: remote-prefill threshold bounds (pools without bounds are absent)."""

    @classmethod
    def from_dict(cls, data: dict) -> RoutingTable:
        """Parse and validate. Raises RoutingTableError naming the first bad field."""
        try:
            version = data["version"]
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise RoutingTableError(f"version must be an integer >= 0, got {version!r}")
            tracks = tuple(Track(str(t["name"]), str(t["model_version"]), float(t["weight"]))
                           for t in data["tracks"])
            raw_models = data.get("models") or {}
            by_track: dict[str, Track] = {}
            for t in tracks:
                by_track.setdefault(t.name, t)
            served = {(str((raw_models.get(t.model_version) or {}).get("model", "")), t.name) for t in tracks}
            if not tracks or len(served) != len(tracks):
                raise RoutingTableError("tracks must be a non-empty list with unique names (per served model)")
            _check_weights(tracks, data.get("models") or {})
            replicas = []
            for pool in data["pools"]:
                role = pool["role"]
                if role not in ROLES:
                    raise RoutingTableError(f"pool {pool['name']!r}: role must be one of {ROLES}, got {role!r}")
                engine = str(pool.get("engine", FERRY))
                if engine not in ENGINE_KINDS:
                    raise RoutingTableError(f"pool {pool['name']!r}: engine must be one of {ENGINE_KINDS}, got "
                                            f"{engine!r}")
                for r in pool["replicas"]:
                    track = by_track.get(r["track"])
                    model_version = r.get("model_version") or (track.model_version if track else None)
                    if model_version is None:
                        raise RoutingTableError(f"replica {r['name']!r}: unknown track {r['track']!r} and no "
                                                "model_version")
                    replicas.append(Replica(str(r["name"]), str(r["url"]).rstrip("/"), str(pool["name"]), role,
                                            str(r["track"]), str(model_version), str(pool.get("datacenter", "")),
                                            engine, *_worker_tokens(pool)))
            if len({r.name for r in replicas}) != len(replicas):
                raise RoutingTableError("replica names must be unique")
            links = tuple(Link(str(x["source"]), str(x["target"]), float(x["bandwidth_gbps"]),
                               float(x.get("rtt_ms", 0.0)), _utilisation(x.get("utilisation", 0.0)))
                          for x in data.get("links", ()))
            length = data.get("length_routing") or {}
            threshold = length.get("threshold_tokens")
            speed = length.get("decode_prefill_tokens_per_s")
            models = {str(k): KVLayout.from_dict(v) for k, v in raw_models.items()}
            versions = {t.model_version for t in tracks} | {r.model_version for r in replicas} | set(models)
            info = {v: _model_info(v, raw_models.get(v) or {}) for v in versions}
            pool_weights = {str(p["name"]): {str(k): float(x) for k, x in p["routing_weights"].items()}
                            for p in data["pools"] if p.get("routing_weights")}
            for name, weights in pool_weights.items():
                try:
                    ScoringWeights.with_overrides(weights)
                except ValueError as exc:
                    raise RoutingTableError(f"pool {name!r}: routing_weights: {exc}") from None
            prefill_speed = length.get("prefill_tokens_per_s")
            raw_keys = data.get("client_keys")
            if raw_keys is not None and not isinstance(raw_keys, list):
                raise RoutingTableError("client_keys must be a list of key entries")
            client_keys = None if raw_keys is None else tuple(KeySpec.from_entry(k) for k in raw_keys)
            pool_bounds = {str(p["name"]): bounds for p in data["pools"] if (bounds := _bounds(p)) is not None}
            return cls(version, tracks, tuple(replicas), links,
                       None if threshold is None else int(threshold), None if speed is None else float(speed),
                       int(length.get("max_tokens", 131072)), models, info, pool_weights,
                       None if prefill_speed is None else float(prefill_speed), client_keys, pool_bounds)
        except RoutingTableError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RoutingTableError(f"invalid routing table: {exc!r}") from exc

    def link(self, source: str, target: str) -> Link | None:
        """The link from datacenter ``source`` to ``target`` (either direction listed), if any."""
        for x in self.links:
            if (x.source, x.target) in ((source, target), (target, source)):
                return x
        return None

    def profile_for(self, prefill: Replica, decode: Replica, *, prefill_queue_requests: float = 0.0) -> PDProfile | None:
        """The PD cost function's inputs for this pair, or None when the model version's KV layout, the link
        between the two datacenters or ``decode_prefill_tokens_per_s`` is missing. The link's measured
        ``utilisation`` is the profile's ``link_share_used``; ``prefill_queue_requests``: the prefill replica's
        waiting requests (the router's scrape), charged only when the prefill speed is known."""
        layout = self.models.get(decode.model_version)
        link = self.link(prefill.datacenter, decode.datacenter)
        if layout is None or link is None or not self.decode_prefill_tokens_per_s:
            return None
        return PDProfile(layout, self.decode_prefill_tokens_per_s, link.bandwidth_gbps, link.rtt_ms / 1000,
                         self.prefill_tokens_per_s, link_share_used=link.utilisation,
                         prefill_queue_requests=max(prefill_queue_requests, 0.0))

    def bounds_for(self, pool: str) -> ThresholdBounds:
        """The pool's threshold bounds (unbounded when the table gives none)."""
        return self.pool_bounds.get(pool, UNBOUNDED)

    def with_link_utilisation(self, utilisation: dict[tuple[str, str], float] | None) -> RoutingTable:
        """This table with each link's ``utilisation`` replaced by ``utilisation[(source, target)]`` (either
        direction's key matches; a measurement above 1 is read as 1); links without a measurement keep the
        table's own value. None or empty: the table unchanged (the same object)."""
        if not utilisation:
            return self
        links = []
        for x in self.links:
            measured = utilisation.get((x.source, x.target), utilisation.get((x.target, x.source)))
            links.append(x if measured is None else replace(x, utilisation=_utilisation(measured)))
        return replace(self, links=tuple(links))

    def threshold_for(self, prefill: Replica, decode: Replica) -> int | None:
        """Cold-fleet remote-prefill threshold for this pair (reporting): the fixed ``threshold_tokens`` when
        set, else :func:`.pd_cost.derived_threshold` of :meth:`profile_for`; None when it cannot be derived."""
        if self.threshold_tokens is not None:
            return self.threshold_tokens
        profile = self.profile_for(prefill, decode)
        return None if profile is None else _derived_threshold(profile, self.max_tokens)


def _check_weights(tracks: tuple[Track, ...], raw_models: dict) -> None:
    """Weights are >= 0 and sum to 100 per served model (all tracks together in tables that name no models)."""
    by_model: dict[str, list[float]] = {}
    for t in tracks:
        by_model.setdefault(str((raw_models.get(t.model_version) or {}).get("model", "")), []).append(t.weight)
    for model, weights in by_model.items():
        if any(w < 0 for w in weights) or not math.isclose(sum(weights), 100.0, abs_tol=1e-6):
            where = f" of model {model!r}" if model else ""
            raise RoutingTableError(f"track weights{where} must be >= 0 and sum to 100, got {weights}")


UNBOUNDED = ThresholdBounds()

BOUND_FIELDS = ("remote_threshold_min_tokens", "remote_threshold_max_tokens")


def _utilisation(value: object) -> float:
    """A link's measured utilisation: a finite number >= 0, read as at most 1."""
    share = float(value)  # type: ignore[arg-type]
    if not (math.isfinite(share) and share >= 0):
        raise RoutingTableError(f"links[].utilisation must be a finite number >= 0, got {value!r}")
    return min(share, 1.0)


def _bounds(pool: dict) -> ThresholdBounds | None:
    """The pool's threshold bounds (None when it sets neither); integers >= 0 with min <= max."""
    low, high = (pool.get(name) for name in BOUND_FIELDS)
    if low is None and high is None:
        return None
    for name, value in zip(BOUND_FIELDS, (low, high), strict=True):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise RoutingTableError(f"pool {pool.get('name')!r}: {name} must be an integer >= 0, got {value!r}")
    if low is not None and high is not None and low > high:
        raise RoutingTableError(f"pool {pool.get('name')!r}: remote_threshold_min_tokens ({low}) must be <= "
                                f"remote_threshold_max_tokens ({high})")
    return ThresholdBounds(low, high)


def _worker_tokens(pool: dict) -> tuple[str, str]:
    """A pool's ``worker_token`` and ``worker_token_previous`` (each optional, a string; "" when absent)."""
    tokens = (pool.get("worker_token") or "", pool.get("worker_token_previous") or "")
    if not all(isinstance(t, str) and t.isascii() and t.isprintable() and " " not in t for t in tokens):
        raise RoutingTableError(f"pool {pool.get('name')!r}: worker_token and worker_token_previous must be "
                                "printable ASCII strings without spaces")
    return tokens


def _model_info(version: str, raw: dict) -> ModelInfo:
    block_size = int(raw.get("block_size", 16))
    if block_size < 1:
        raise RoutingTableError(f"models[{version!r}].block_size must be >= 1, got {block_size}")
    return ModelInfo(str(raw.get("model", "")), str(raw.get("tokenizer", "")), str(raw.get("weights_sha256", "")),
                     str(raw.get("kv_dtype", "")), block_size)


def derived_threshold(layout: KVLayout, *, bandwidth_gbps: float, rtt_s: float, decode_prefill_tokens_per_s: float,
                      max_tokens: int = 131072, prefill_tokens_per_s: float | None = None) -> int | None:
    """Cold-fleet threshold of the one PD cost function (:func:`.pd_cost.derived_threshold`), keyword form.

    Returns:
        ``T``: with no cache hits, remote prefill iff ``num_prompt_tokens > T``; None if never up to ``max_tokens``.

    Raises:
        ValueError: non-positive bandwidth or speed, negative RTT.
    """
    profile = PDProfile(layout, decode_prefill_tokens_per_s, bandwidth_gbps, rtt_s, prefill_tokens_per_s)
    return _derived_threshold(profile, max_tokens)
