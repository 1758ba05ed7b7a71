"""Scoring a replica for one request: expected cached tokens against load (torch-free).

``score = hit * expected_cached_tokens - pending_prefill * pending_prefill_tokens - waiting * num_waiting
- running * num_running - kv_usage * kv_usage_ratio``

in prompt-token units (a point of score is one prompt token the replica will not have to prefill).
For ``cache_aware`` (``LoadTracker.cache_signals``) ``pending_prefill_tokens`` is the uncached prompt work
this router sent the replica that has not produced a first byte yet and ``num_waiting`` the engine's
scraped queue less those requests of this router (each queued request is charged once: by its tokens when the
router knows them, else by ``waiting``); ``least_loaded`` (``LoadTracker.signals``) has no pending tokens and counts every in-flight
request as waiting.
The highest score wins; ties go to the session's rendezvous hash (:func:`session_rank`: the same
session lands on the same replica while nothing else differs, which also makes its next turn a hit),
then to the replica given the fewest requests so far.

Default weights (:class:`ScoringWeights`), and why:

- ``hit = 2.0``: a cached token is a token not prefilled, and under load that saves twice: the request's own
  first token comes about one token's prefill sooner (the unit of the score), and the requests that arrive
  behind it on that replica start that much sooner too, since the engine computes one prefill after another.
  With ``hit = 1`` the score is only this request's own expected wait, a greedy choice that moves a session
  away from its history whenever another request's pending prefill on its replica is larger than the history:
  the move recomputes the history and delays everyone behind it. ``bench/routing.py`` at 16 sessions thinking
  3 s between turns (two CPU decode replicas busy, TTFT about 1-1.5 s), same host, one run each
  (2026-12-02): ``hit = 1`` moved 15 of 112 later turns and computed 16,683 prefill tokens (least-loaded
  23,355: 1.40x), TTFT p50 1.29x lower; ``hit = 2`` moved 3 of 112, 13,915 tokens (least-loaded 22,539:
  1.62x), TTFT p50 1.37x lower. The queued-request and KV-usage terms below still move a session when its
  replica is really congested (one queued request outweighs a 256-token history).
- ``pending_prefill = 1.0``: a prompt token another request is still prefilling on the replica delays our
  first token by about as much as a token we must prefill ourselves (one engine computes both), so a
  session's cached history is weighed against the prefill actually ahead of it. Counting every in-flight
  request as a queued one (``waiting``, 512 tokens) instead moved a session away from its cache whenever
  its replica had one more request in flight, even one already decoding (``bench/routing.py``).
- ``waiting = 512``: a request queued ahead of us delays our first token by about one prefill; 512
  tokens is the order of a first-turn prompt of ``bench/multi_turn.py``'s default sessions (300-token
  system prompt + 100..300 user tokens), so one queued request outweighs a hit of less than 256 tokens
  (at ``hit = 2``) while a long shared history still pulls a session to a slightly busier replica.
- ``running = 32``: a running request slows every decode step a little (batched) but does not delay
  our prefill start; a small cost that spreads decode load among equally cached replicas.
- ``kv_usage = 1024``: a nearly full KV cache preempts or evicts; at usage 1.0 the replica is
  charged two typical prompts, enough to move new sessions elsewhere before it thrashes.

Pools override any weight in the routing table (``"routing_weights": {"waiting": 256}``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class ScoringWeights:
    """Weights of the score (see the module docstring for the reasoning behind each default)."""

    hit: float = 2.0
    """Per expected cached prompt token (tier-weighted)."""
    pending_prefill: float = 1.0
    """Per uncached prompt token of requests sent to the replica that have no first byte yet."""
    waiting: float = 512.0
    """Per request waiting on the replica (``cache_aware``: the scraped queue depth less this router's requests
    before their first byte, which ``pending_prefill`` charges; ``least_loaded``: the scraped queue depth plus
    this router's in-flight requests)."""
    running: float = 32.0
    """Per request in the replica's running batch."""
    kv_usage: float = 1024.0
    """At KV cache usage ratio 1.0 (linear in the ratio)."""

    @classmethod
    def with_overrides(cls, overrides: dict[str, float] | None) -> ScoringWeights:
        """Defaults with ``overrides`` applied.

        Raises:
            ValueError: an unknown weight name or a negative weight.
        """
        if not overrides:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown routing weights {sorted(unknown)}; known: {sorted(known)}")
        if any(v < 0 for v in overrides.values()):
            raise ValueError(f"routing weights must be >= 0, got {overrides}")
        return replace(cls(), **{k: float(v) for k, v in overrides.items()})


@dataclass(frozen=True)
class ReplicaLoad:
    """Load signals of one replica."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage_ratio: float = 0.0
    pending_prefill_tokens: float = 0.0


def score(expected_cached_tokens: float, load: ReplicaLoad, weights: ScoringWeights) -> float:
    """The score of the module docstring (higher is better), in prompt tokens."""
    return (weights.hit * expected_cached_tokens - weights.pending_prefill * load.pending_prefill_tokens
            - weights.waiting * load.waiting - weights.running * load.running - weights.kv_usage * load.kv_usage_ratio)


def session_rank(session: str, replica: str) -> int:
    """Rendezvous (highest random weight) hash of a session on a replica: first 8 bytes of
    ``sha256(session || 0x00 || replica)``, big-endian."""
    return int.from_bytes(hashlib.sha256(session.encode() + b"\x00" + replica.encode()).digest()[:8], "big")
