"""Routing building blocks (torch-free): the track split and per-replica load; the pipeline is :mod:`.pipeline`.

**Track**: :func:`track_bucket` hashes the sticky key (``X-Ferry-Sticky-Key``, else the session, else the
request id) to a bucket ``0..9999``; tracks own consecutive bucket ranges in table order,
``round(cumulative_weight_percent * 100)`` wide (weights rescaled to the tracks of the requested model),
so a 90/10 split sends buckets 0..8999 to the first track. The same key always lands on the same track.
"""

from __future__ import annotations

import hashlib
from collections import Counter

from inference_worker.router.scoring import ReplicaLoad
from inference_worker.router.table import Replica, Track

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
    """The track owning ``track_bucket(key)`` (see the module docstring; weights rescaled to their sum)."""
    bucket = track_bucket(key)
    total = sum(t.weight for t in tracks) or 100.0
    cumulative = 0.0
    for track in tracks:
        cumulative += track.weight
        if bucket < round(cumulative * NUM_BUCKETS / total):
            return track
    return tracks[-1]


class LoadTracker:
    """Per-replica load: requests this router has in flight plus what is scraped from the replica's
    ``/metrics`` (``ferry_num_requests_waiting``, ``ferry_num_requests_running``, ``ferry_kv_cache_usage_ratio``).

    :meth:`pick` does not change state; ties go to the replica assigned the fewest requests so far
    (then table order), which spreads sequential traffic evenly over idle replicas.
    """

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.pending_prefill_tokens: Counter[str] = Counter()
        """Per replica: prompt tokens to prefill (not cached) of this router's requests before their first byte."""
        self.pending_requests: Counter[str] = Counter()
        """Per replica: this router's requests before their first byte (queued in the engine or prefilling)."""
        self.assigned: Counter[str] = Counter()
        self.queue_depth: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.kv_usage: dict[str, float] = {}

    def load(self, replica: Replica) -> float:
        """In-flight requests plus the last scraped queue depth."""
        return self.in_flight[replica.name] + self.queue_depth.get(replica.name, 0.0)

    def signals(self, replica: Replica) -> ReplicaLoad:
        """Scoring input of ``least_loaded``: waiting = :meth:`load` (every in-flight request counts as queued),
        running and KV usage as last scraped (0 when unknown)."""
        return ReplicaLoad(self.load(replica), self.running.get(replica.name, 0.0),
                           self.kv_usage.get(replica.name, 0.0))

    def cache_signals(self, replica: Replica) -> ReplicaLoad:
        """Scoring input of ``cache_aware``: the prefill work this router has sent the replica that has not
        produced its first byte yet (:attr:`pending_prefill_tokens`, in prompt tokens), waiting = the scraped queue
        depth less this router's requests without a first byte (:attr:`pending_requests`, at least 0: the queued
        requests of other routers or clients, whose size this router does not know), running and KV usage as
        scraped.

        An in-flight request is charged for what it delays a new one by: its uncached prompt tokens until its
        first byte (continuous batching schedules a new prefill next to running decodes), then only as running.
        One of this router's own requests queued in the engine is charged once, by its tokens: charging it also
        as a scraped waiting request (``waiting`` weight, 512 tokens) counted the same delay twice and moved a
        session off its cached replica whenever the engine had a queue (``bench/routing.py``).
        """
        others_waiting = max(self.queue_depth.get(replica.name, 0.0) - self.pending_requests[replica.name], 0.0)
        return ReplicaLoad(others_waiting, self.running.get(replica.name, 0.0), self.kv_usage.get(replica.name, 0.0),
                           float(max(self.pending_prefill_tokens[replica.name], 0)))

    def forget(self, name: str) -> None:
        """Drop the scraped signals of a replica (unreachable)."""
        for signals in (self.queue_depth, self.running, self.kv_usage):
            signals.pop(name, None)

    def pick(self, candidates: list[Replica], exclude: set[str] = frozenset()) -> Replica | None:
        """The least-loaded candidate not in ``exclude`` (None if none is left)."""
        left = [r for r in candidates if r.name not in exclude]
        if not left:
            return None
        return min(left, key=lambda r: (self.load(r), self.assigned[r.name]))

    def assign(self, replica: Replica) -> None:
        """Record that a request was given to ``replica`` without tracking its completion (prefill)."""
        self.assigned[replica.name] += 1

    def begin(self, replica: Replica, prefill_tokens: int = 0) -> None:
        """A request to ``replica`` starts; ``prefill_tokens``: its prompt tokens the replica will compute (not
        cached), pending until :meth:`prefill_done`."""
        self.assigned[replica.name] += 1
        self.in_flight[replica.name] += 1
        self.pending_requests[replica.name] += 1
        self.pending_prefill_tokens[replica.name] += prefill_tokens

    def prefill_done(self, replica: Replica, prefill_tokens: int) -> None:
        """The request begun with ``prefill_tokens`` got its first byte back, or ended without one (call exactly
        once per :meth:`begin`)."""
        self.pending_requests[replica.name] -= 1
        self.pending_prefill_tokens[replica.name] -= prefill_tokens

    def end(self, replica: Replica) -> None:
        """A request to ``replica`` finished (successfully or not)."""
        self.in_flight[replica.name] -= 1
