"""The one PD cost function: prefill locally on the decode replica, or remotely on a prefill replica (torch-free).

A request of ``N`` prompt tokens of which the chosen decode replica already holds ``h_decode`` (its
prefix cache, the hybrid hit rule) and the chosen prefill replica holds ``h_prefill`` costs, in
seconds until its KV sits on the decode replica::

    local  = w_decode  + (N - h_decode)  / s_decode
    remote = w_prefill + q * N / s_prefill + (N - h_prefill) / s_prefill  +  bytes(N) / (B * (1 - u))  +  RTT

``s_decode`` and ``s_prefill`` are the two pools' prefill speeds (tokens/s), ``bytes(N)`` the KV the
hand-off ships (today the whole prompt's: :meth:`KVLayout.transfer_bytes`, ``N`` tokens per full layer
and ``min(N, W-1)`` per sliding layer), ``B = bandwidth_gbps * 1e9 / 8`` bytes/s and ``RTT`` the link's
round trip; ``w_decode``/``w_prefill`` are the queue waits before each pool starts the prefill (seconds, 0
by default), ``q`` the requests waiting on the prefill replica, each charged the prefill time of a prompt
of this request's length (``N / s_prefill``: the router's estimate of the prefill queue's wait; a prefill
pool gets the long prompts past the threshold, and without a prompt-length distribution the prompt at hand
is the best per-request estimate; 0 by default) and ``u`` the share of the link other transfers already use (0 by default; at
``u = 1`` the link is saturated and the transfer term, so remote, is infinite). The router feeds ``q`` and
``u`` from the scraped queue depth and the measured link load (:mod:`.pipeline`, issue 24); the planner feeds
the waits. Remote prefill is chosen iff ``remote < local``. Deciding on the *incremental* length
(the part not already cached) follows the PrfaaS paper's remote-prefill rule (figures in the planner
issue). ``s_prefill`` may be unknown (None): the prefill pool's time is then not charged, which is the
decode pool's own view (what it saves versus what the transfer costs) and gives the threshold Ferry
derived before cache hits were known (:func:`derived_threshold`). The capacity planner feeds measured
profiles and live link load into :class:`PDProfile`; nothing else in Ferry computes a threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inference_worker.kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class PDProfile:
    """What the cost function knows about one (decode replica, prefill replica) pair."""

    layout: KVLayout
    """KV geometry of the model version (bytes shipped per token per layer)."""
    decode_prefill_tokens_per_s: float
    """Prefill speed of the decode replica, tokens/s (> 0)."""
    bandwidth_gbps: float
    """Link bandwidth between the two datacenters, Gbit/s (> 0)."""
    rtt_s: float = 0.0
    """Link round trip, seconds (>= 0)."""
    prefill_tokens_per_s: float | None = None
    """Prefill speed of the prefill replica, tokens/s; None: its time is not charged (see the module docstring)."""
    decode_wait_s: float = 0.0
    """Queue wait before the decode replica starts a local prefill, seconds (>= 0)."""
    prefill_wait_s: float = 0.0
    """Queue wait before the prefill replica starts a remote prefill, seconds (>= 0)."""
    link_share_used: float = 0.0
    """Share of the link's bandwidth other transfers already use, in [0, 1] (1: saturated, remote never wins)."""
    prefill_queue_requests: float = 0.0
    """Requests waiting on the prefill replica (>= 0), each charged ``N / s_prefill`` (module docstring)."""

    def __post_init__(self) -> None:
        if self.decode_prefill_tokens_per_s <= 0 or self.bandwidth_gbps <= 0 or self.rtt_s < 0:
            raise ValueError("decode_prefill_tokens_per_s and bandwidth_gbps must be positive, rtt_s >= 0")
        if self.decode_wait_s < 0 or self.prefill_wait_s < 0 or not 0 <= self.link_share_used <= 1:
            raise ValueError("decode_wait_s and prefill_wait_s must be >= 0 and link_share_used in [0, 1]")
        if not 0 <= self.prefill_queue_requests < math.inf:
            raise ValueError(f"prefill_queue_requests must be finite and >= 0, got {self.prefill_queue_requests}")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive (or None)")


@dataclass(frozen=True)
class PDCosts:
    """Seconds until the prompt's KV is on the decode replica, both ways."""

    local_s: float
    remote_s: float

    @property
    def remote(self) -> bool:
        """True iff remote prefill is strictly cheaper."""
        return self.remote_s < self.local_s


def pd_costs(profile: PDProfile, num_tokens: int, *, decode_hit_tokens: int = 0, prefill_hit_tokens: int = 0) -> PDCosts:
    """Local and remote cost of a prompt of ``num_tokens`` tokens (formula in the module docstring).

    Args:
        num_tokens: prompt tokens N (>= 0).
        decode_hit_tokens / prefill_hit_tokens: tokens of the prompt cached on each replica, clamped to [0, N].

    Raises:
        ValueError: negative ``num_tokens``.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    h_decode = min(max(decode_hit_tokens, 0), num_tokens)
    h_prefill = min(max(prefill_hit_tokens, 0), num_tokens)
    local = profile.decode_wait_s + (num_tokens - h_decode) / profile.decode_prefill_tokens_per_s
    remote_compute = profile.prefill_wait_s
    if profile.prefill_tokens_per_s is not None:
        queued_tokens = profile.prefill_queue_requests * num_tokens
        remote_compute += (queued_tokens + num_tokens - h_prefill) / profile.prefill_tokens_per_s
    bytes_per_s = profile.bandwidth_gbps * 1e9 / 8 * (1 - profile.link_share_used)
    transfer = profile.layout.transfer_bytes(num_tokens) / bytes_per_s if bytes_per_s > 0 else math.inf
    return PDCosts(local, remote_compute + transfer + profile.rtt_s)


def derived_threshold(profile: PDProfile, max_tokens: int = 131072) -> int | None:
    """Largest prompt length that still prefills locally on a cold fleet (no hits on either replica).

    ``f(N) = local(N) - remote(N)`` is piecewise linear with a slope that only grows (sliding layers stop
    adding bytes at ``W-1``, so ``-bytes(N)`` is convex), so ``{N : f(N) <= 0}`` (local is no worse) is
    one interval. With no waits ``f(0) = -RTT <= 0`` and remote wins exactly for ``N > T``; a decode queue
    longer than the prefill queue can make remote win at ``N = 0`` too, and ``T`` is then the interval's
    right end (-1 when it is empty). Found by bisection over ``0..max_tokens``: O(log max_tokens) calls.

    Returns:
        ``T`` (remote for every ``num_tokens > T`` with no hits), or None if remote does not win at
        ``max_tokens``.
    """
    def gain(n: int) -> float:
        costs = pd_costs(profile, n)
        return costs.local_s - costs.remote_s

    if gain(max_tokens) <= 0:
        return None
    lo = 0
    if gain(0) > 0:
        # Both ends favour remote: find the minimum of the convex gain (first n whose forward step is >= 0).
        left, right = 0, max_tokens
        while left < right:
            mid = (left + right) // 2
            if gain(mid + 1) >= gain(mid):
                right = mid
            else:
                left = mid + 1
        if gain(left) > 0:
            return -1
        lo = left
    hi = max_tokens  # invariant: gain(lo) <= 0, gain(hi) > 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if gain(mid) > 0:
            hi = mid
        else:
            lo = mid
    return lo
