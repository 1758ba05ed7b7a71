"""Bounded in-flight requests per client and overall (the router's request-level admission; torch-free).

A request holds one seat from the moment its key is accepted until its answer has been sent (a streamed
answer: until the stream ends or the client leaves). Seats are checked *before* the body is read, so an
overloaded router spends nothing on a request it will refuse:

- over ``max_in_flight_per_key`` seats for one client (its API key name; without keys, its address):
  **429** with ``Retry-After`` -- that client is sending too much at once;
- over ``max_in_flight`` seats in all: **503** with ``Retry-After`` -- the router is full; another router
  or a later try can take it.

Nothing waits in a queue: the bound *is* the queue (requests admitted and waiting on replicas), and a
refusal costs the client one round trip. ``Retry-After`` is one second (the whole-second granularity of
RFC 9110 section 10.2.3; seats free as fast as requests finish). This is distinct from the per-key *rate*
limit (:mod:`.auth`, requests per second), and from the pipeline's admission step (:func:`.pipeline.admit`),
which books a plan's replicas once a request is routed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: the HTTP status (429 or 503), message and ``Retry-After`` seconds."""

    status: int
    message: str
    reason: str
    """``per_key`` or ``overall`` (the ``reason`` label of ``ferry_router_admission_refused_total``)."""
    retry_after_s: int = RETRY_AFTER_S


class InFlightLimits:
    """Seats per client and overall.

    Args:
        max_in_flight: seats in all (>= 1).
        max_in_flight_per_key: seats per client (>= 1).

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_in_flight: int, max_in_flight_per_key: int):
        if max_in_flight < 1 or max_in_flight_per_key < 1:
            raise ValueError(f"in-flight bounds must be >= 1, got {max_in_flight} and {max_in_flight_per_key}")
        self.max_in_flight, self.max_in_flight_per_key = max_in_flight, max_in_flight_per_key
        self.num_in_flight = 0
        self.per_key: Counter[str] = Counter()

    def enter(self, key: str) -> Refusal | None:
        """Take a seat for ``key``, or return why not (nothing is taken then)."""
        if self.per_key[key] >= self.max_in_flight_per_key:
            return Refusal(429, f"client {key!r} already has {self.per_key[key]} requests in flight (at most "
                                f"{self.max_in_flight_per_key}); retry when one finishes", "per_key")
        if self.num_in_flight >= self.max_in_flight:
            return Refusal(503, f"the router has {self.num_in_flight} requests in flight (at most "
                                f"{self.max_in_flight}); retry shortly or on another router", "overall")
        self.per_key[key] += 1
        self.num_in_flight += 1
        return None

    def leave(self, key: str) -> None:
        """Give back ``key``'s seat (exactly once per successful :meth:`enter`)."""
        self.num_in_flight -= 1
        self.per_key[key] -= 1
        if self.per_key[key] <= 0:
            del self.per_key[key]
