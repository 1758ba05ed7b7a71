"""Token bucket (torch-free): the per-link bandwidth cap of the KV sender and the router's per-key rate limit.

Algorithm: the bucket holds up to ``burst`` tokens and refills at ``rate_per_s`` tokens per second.
:meth:`TokenBucket.reserve` always takes the tokens, letting the level go negative (debt), and returns
how long the caller must wait for the debt to be repaid -- so concurrent users of one bucket share the
rate. :meth:`TokenBucket.try_acquire` takes tokens only when they are there, otherwise reports when
they will be (an HTTP 429's ``Retry-After``). For a KV link, tokens are bytes and
``rate_per_s = bandwidth_gbps * 1e9 / 8``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class TokenBucket:
    """A token bucket with an injectable clock and sleep, and accounting of the waits it asked for.

    Args:
        rate_per_s: refill rate (tokens per second, > 0).
        burst: capacity in tokens (> 0); the bucket starts full.
        clock: monotonic seconds (default ``time.monotonic``).
        sleep: awaitable sleep used by :meth:`acquire` (default ``asyncio.sleep``).

    Raises:
        ValueError: non-positive rate or burst.
    """

    def __init__(self, rate_per_s: float, burst: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        if not rate_per_s > 0 or not burst > 0:
            raise ValueError(f"rate_per_s and burst must be positive, got {rate_per_s} and {burst}")
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._updated = clock()
        self.total_tokens = 0.0
        """Tokens taken so far (bytes, for a link)."""
        self.total_wait_s = 0.0
        """Sum of the waits :meth:`acquire` asked for, seconds."""
        self.num_waits = 0
        """How many times :meth:`acquire` had to wait."""

    @classmethod
    def for_link(cls, bandwidth_gbps: float, *, burst_bytes: int = 1 << 20, **kwargs) -> TokenBucket:
        """A byte bucket for a link of ``bandwidth_gbps`` Gbit/s (``rate = gbps * 1e9 / 8`` bytes/s)."""
        if not bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be positive, got {bandwidth_gbps}")
        return cls(bandwidth_gbps * 1e9 / 8, burst_bytes, **kwargs)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate_per_s)
        self._updated = now

    def reserve(self, amount: float) -> float:
        """Take ``amount`` tokens now (possibly into debt); return the seconds to wait before using them."""
        if amount < 0:
            raise ValueError(f"amount must be >= 0, got {amount}")
        self._refill()
        self._tokens -= amount
        self.total_tokens += amount
        return max(0.0, -self._tokens / self.rate_per_s)

    def try_acquire(self, amount: float = 1.0) -> float:
        """Take ``amount`` tokens if available and return 0.0; else take nothing and return seconds until
        they would be available (``inf`` if ``amount`` exceeds ``burst``)."""
        self._refill()
        if self._tokens >= amount:
            self._tokens -= amount
            self.total_tokens += amount
            return 0.0
        if amount > self.burst:
            return float("inf")
        return (amount - self._tokens) / self.rate_per_s

    async def acquire(self, amount: float) -> None:
        """Take ``amount`` tokens, sleeping until the bucket's rate allows it."""
        wait = self.reserve(amount)
        if wait > 0:
            self.total_wait_s += wait
            self.num_waits += 1
            await self._sleep(wait)
