"""Pure routing decisions (torch-free): track split, length-aware prefill placement, version pairing, load.

A request is routed in four steps (see :func:`plan_route`):

1. **Track**: :func:`track_bucket` hashes the sticky key (the request id unless the client sends
   ``X-Ferry-Sticky-Key``) to a bucket ``0..9999``; tracks own consecutive bucket ranges in table
   order, ``round(cumulative_weight_percent * 100)`` wide, so a 90/10 split sends buckets 0..8999 to
   the first track. The same key always lands on the same track.
2. **Decode replica**: decode or colocated replicas of that track and its model version, least loaded
   first (:class:`LoadTracker`).
3. **Prefill placement**: prefill replicas of the *same model version* only (KV is only valid for the
   weights that produced it). The prompt goes to remote prefill iff it has more tokens than the
   threshold (:meth:`RoutingTable.threshold_for`); otherwise the decode replica prefills it itself.
4. **Retry**: the caller asks :meth:`LoadTracker.pick` again with the replicas already tried excluded.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

from inference_worker.router.table import DECODE_ROLES, Replica, RoutingTable, Track

NUM_BUCKETS = 10_000
LOCAL_PREFILL, REMOTE_PREFILL, LOCAL_PREFILL_FALLBACK = "local_prefill", "remote_prefill", "local_prefill_fallback"
DECISIONS = (LOCAL_PREFILL, REMOTE_PREFILL, LOCAL_PREFILL_FALLBACK)
"""``decision`` label values: short prompt; long prompt sent to a prefill pool; long prompt with no
same-version prefill replica available (prefilled locally instead)."""


class NoReplicaAvailable(LookupError):
    """No replica can serve the request (the router answers 503)."""


def track_bucket(key: str) -> int:
    """``int.from_bytes(sha256(key.encode("utf-8")).digest()[:8], "big") % 10000``."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % NUM_BUCKETS


def choose_track(tracks: tuple[Track, ...], key: str) -> Track:
    """The track owning ``track_bucket(key)`` (see the module docstring)."""
    bucket = track_bucket(key)
    cumulative = 0.0
    for track in tracks:
        cumulative += track.weight
        if bucket < round(cumulative * NUM_BUCKETS / 100):
            return track
    return tracks[-1]


class LoadTracker:
    """Per-replica load: requests this router has in flight plus the queue depth scraped from the
    replica's ``/metrics`` (``ferry_num_requests_waiting``).

    :meth:`pick` does not change state; ties go to the replica assigned the fewest requests so far
    (then table order), which spreads sequential traffic evenly over idle replicas.
    """

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.assigned: Counter[str] = Counter()
        self.queue_depth: dict[str, float] = {}

    def load(self, replica: Replica) -> float:
        """In-flight requests plus the last scraped queue depth."""
        return self.in_flight[replica.name] + self.queue_depth.get(replica.name, 0.0)

    def pick(self, candidates: list[Replica], exclude: set[str] = frozenset()) -> Replica | None:
        """The least-loaded candidate not in ``exclude`` (None if none is left)."""
        left = [r for r in candidates if r.name not in exclude]
        if not left:
            return None
        return min(left, key=lambda r: (self.load(r), self.assigned[r.name]))

    def assign(self, replica: Replica) -> None:
        """Record that a request was given to ``replica`` without tracking its completion (prefill)."""
        self.assigned[replica.name] += 1

    def begin(self, replica: Replica) -> None:
        """A request to ``replica`` starts."""
        self.assigned[replica.name] += 1
        self.in_flight[replica.name] += 1

    def end(self, replica: Replica) -> None:
        """A request to ``replica`` finished (successfully or not)."""
        self.in_flight[replica.name] -= 1


@dataclass(frozen=True)
class RoutePlan:
    """Where one request goes."""

    track: Track
    decision: str
    decode_candidates: list[Replica]
    """Decode/colocated replicas of the track's version; the proxy picks among them (and retries)."""
    prefill: Replica | None
    """The prefill replica for ``remote_prefill``, else None."""
    threshold_tokens: int | None


def plan_route(table: RoutingTable, *, key: str, num_prompt_tokens: int, loads: LoadTracker) -> RoutePlan:
    """Decide track, decode candidates and prefill placement (see the module docstring).

    Raises:
        NoReplicaAvailable: the chosen track's model version has no decode or colocated replica.
    """
    track = choose_track(table.tracks, key)
    version = track.model_version
    decode = [r for r in table.replicas if r.role in DECODE_ROLES and r.model_version == version]
    same_track = [r for r in decode if r.track == track.name]
    decode = same_track or decode
    if not decode:
        raise NoReplicaAvailable(f"no decode replica serves model version {version!r} (track {track.name!r})")
    prefill_pool = [r for r in table.replicas if r.role == "prefill" and r.model_version == version]
    prefill = loads.pick(prefill_pool) if prefill_pool else None
    if prefill is None:
        threshold = table.threshold_tokens
        long_prompt = threshold is not None and num_prompt_tokens > threshold
        return RoutePlan(track, LOCAL_PREFILL_FALLBACK if long_prompt else LOCAL_PREFILL, decode, None, threshold)
    # The threshold depends on the link between datacenters: taken for the decode replica picked now.
    threshold = table.threshold_for(prefill, loads.pick(decode))
    if threshold is not None and num_prompt_tokens > threshold:
        return RoutePlan(track, REMOTE_PREFILL, decode, prefill, threshold)
    return RoutePlan(track, LOCAL_PREFILL, decode, None, threshold)
