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
         "replicas": [{"name": "decode-dc1-0", "url": "http://10.0.0.5:8000", "track": "stable",
                       "model_version": "v1"}]},                             # model_version: default = track's
        {"name": "prefill-dc2", "role": "prefill", "datacenter": "dc2", "replicas": [...]}
      ],
      "links": [{"source": "dc2", "target": "dc1", "bandwidth_gbps": 10, "rtt_ms": 20}],
      "length_routing": {"threshold_tokens": 2048},    # fixed threshold, or derived:
      # "length_routing": {"decode_prefill_tokens_per_s": 4000, "max_tokens": 131072},
      "models": {"v1": {"layer_types": [...], "sliding_window": 512, "num_kv_heads": 1, "head_dim": 256,
                        "dtype": "bfloat16"}}           # KV layout per model version (derived threshold)
    }

Prompts with more than the threshold's tokens prefill on the remote prefill pool; the others on
the decode pool. :func:`derived_threshold` documents the formula of the derived threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from inference_worker.kv_transfer.layout import KVLayout

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

    @classmethod
    def from_dict(cls, data: dict) -> RoutingTable:
        """Parse and validate. Raises RoutingTableError naming the first bad field."""
        try:
            version = data["version"]
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise RoutingTableError(f"version must be an integer >= 0, got {version!r}")
            tracks = tuple(Track(str(t["name"]), str(t["model_version"]), float(t["weight"]))
                           for t in data["tracks"])
            by_track = {t.name: t for t in tracks}
            if not tracks or len(by_track) != len(tracks):
                raise RoutingTableError("tracks must be a non-empty list with unique names")
            if any(t.weight < 0 for t in tracks) or not math.isclose(sum(t.weight for t in tracks), 100.0,
                                                                   abs_tol=1e-6):
                raise RoutingTableError(f"track weights must be >= 0 and sum to 100, got "
                                        f"{[t.weight for t in tracks]}")
            replicas = []
            for pool in data["pools"]:
                role = pool["role"]
                if role not in ROLES:
                    raise RoutingTableError(f"pool {pool['name']!r}: role must be one of {ROLES}, got {role!r}")
                for r in pool["replicas"]:
                    track = by_track.get(r["track"])
                    model_version = r.get("model_version") or (track.model_version if track else None)
                    if model_version is None:
                        raise RoutingTableError(f"replica {r['name']!r}: unknown track {r['track']!r} and no "
                                                "model_version")
                    replicas.append(Replica(str(r["name"]), str(r["url"]).rstrip("/"), str(pool["name"]), role,
                                            str(r["track"]), str(model_version), str(pool.get("datacenter", ""))))
            if len({r.name for r in replicas}) != len(replicas):
                raise RoutingTableError("replica names must be unique")
            links = tuple(Link(str(x["source"]), str(x["target"]), float(x["bandwidth_gbps"]),
                               float(x.get("rtt_ms", 0.0))) for x in data.get("links", ()))
            length = data.get("length_routing") or {}
            threshold = length.get("threshold_tokens")
            speed = length.get("decode_prefill_tokens_per_s")
            models = {str(k): KVLayout.from_dict(v) for k, v in (data.get("models") or {}).items()}
            return cls(version, tracks, tuple(replicas), links,
                       None if threshold is None else int(threshold), None if speed is None else float(speed),
                       int(length.get("max_tokens", 131072)), models)
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

    def threshold_for(self, prefill: Replica, decode: Replica) -> int | None:
        """Remote-prefill threshold in prompt tokens for this pair: prompts with more tokens go remote.

        The fixed ``threshold_tokens`` when set; else :func:`derived_threshold` from the link between
        the two datacenters, the model version's KV layout and ``decode_prefill_tokens_per_s``; None
        (never remote) when any of those is missing.
        """
        if self.threshold_tokens is not None:
            return self.threshold_tokens
        layout = self.models.get(decode.model_version)
        link = self.link(prefill.datacenter, decode.datacenter)
        if layout is None or link is None or not self.decode_prefill_tokens_per_s:
            return None
        return derived_threshold(layout, bandwidth_gbps=link.bandwidth_gbps, rtt_s=link.rtt_ms / 1000,
                                 decode_prefill_tokens_per_s=self.decode_prefill_tokens_per_s,
                                 max_tokens=self.max_tokens)


def derived_threshold(layout: KVLayout, *, bandwidth_gbps: float, rtt_s: float, decode_prefill_tokens_per_s: float,
                      max_tokens: int = 131072) -> int | None:
    """Largest prompt length that should still prefill locally on the decode pool.

    Remote prefill of ``N`` tokens pays off when the prefill time it saves the decode pool exceeds
    the cost of moving the KV::

        N / s  >  bytes(N) / B + RTT

    with ``s`` the decode pool's measured prefill speed (tokens/s), ``bytes(N)`` the KV sent after a
    prefill of ``N`` tokens (:meth:`KVLayout.transfer_bytes`: ``N`` tokens per full layer,
    ``min(N, W-1)`` per sliding layer), ``B = bandwidth_gbps * 1e9 / 8`` bytes/s and ``RTT`` seconds.
    ``f(N) = N/s - bytes(N)/B - RTT`` is piecewise linear with a slope that only grows (sliding layers
    stop adding bytes at ``W-1``), so it is convex with ``f(0) < 0``: it is positive exactly for
    ``N > T``. ``T`` is found by bisection over ``1..max_tokens``.

    Returns:
        ``T`` (route to remote prefill iff ``num_prompt_tokens > T``), or None if remote prefill never
        pays off up to ``max_tokens``.

    Raises:
        ValueError: non-positive bandwidth or speed, negative RTT.
    """
    if bandwidth_gbps <= 0 or decode_prefill_tokens_per_s <= 0 or rtt_s < 0:
        raise ValueError("bandwidth_gbps and decode_prefill_tokens_per_s must be positive, rtt_s >= 0")
    bytes_per_s = bandwidth_gbps * 1e9 / 8

    def pays_off(n: int) -> bool:
        return n / decode_prefill_tokens_per_s > layout.transfer_bytes(n) / bytes_per_s + rtt_s

    if not pays_off(max_tokens):
        return None
    lo, hi = 0, max_tokens  # invariant: not pays_off(lo) (f(0) = -RTT <= 0), pays_off(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pays_off(mid):
            hi = mid
        else:
            lo = mid
    return lo
