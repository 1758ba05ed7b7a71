"""Circuit breaking: the router ejects a failing replica for a cooldown, then probes it (torch-free).

Seed ``003`` 9.1: "当单实例错误率超过5%，自动摘除并重启冷却" (a replica whose error rate passes 5% is
removed and cooled down). Per replica (decode or prefill, by name), one :class:`CircuitBreaker` keeps

- **closed** (serving): the outcomes of the last ``window_s`` seconds. The replica is *ejected* when
  ``max_consecutive_failures`` attempts in a row failed (reason ``consecutive_failures``), or when the
  window holds at least ``min_requests`` outcomes and more than ``max_error_rate`` of them failed
  (reason ``error_rate``; strictly more: 1 of 20 is exactly 5% and keeps the replica);
- **open** (ejected): no request is planned on it until ``cooldown_s`` has passed since the ejection;
- **half-open**: after the cooldown one request at a time is let through as a probe. A successful probe
  closes the breaker (a fresh window); a failed one opens it again (reason ``probe_failed``) with the
  cooldown doubled, up to ``max_cooldown_s``; the cooldown returns to ``cooldown_s`` once it closes.

What counts: a connection error, a timeout, a 5xx answer or a stream that broke is a **failure** of the
replica; any answer below 500 (a 4xx is the client's error: a prompt over a limit, a bad parameter) is a
**success** -- a client error never ejects a replica. A 503 from a draining worker is a failure like any
5xx (it stops taking requests), which is what the router wants anyway.

The breaker only decides; :mod:`.app` asks it for :meth:`CircuitBreaker.ejected` at eligibility (the
pipeline's step 1), tells it each attempt's outcome and turns the returned :class:`Transition` into the
``ferry_router_ejections_total`` counter and ``ferry_router_replica_ejected`` gauge.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
EJECTION_REASONS = ("error_rate", "consecutive_failures", "probe_failed")
"""``reason`` label values of ``ferry_router_ejections_total``."""


@dataclass(frozen=True)
class BreakerConfig:
    """Circuit breaker settings (router CLI ``--breaker-*``).

    Raises:
        ValueError: a value out of range (from ``__post_init__``).
    """

    window_s: float = 30.0
    """Seconds of outcomes the error rate is computed over."""
    max_error_rate: float = 0.05
    """Eject when the window's failure ratio is above this (seed 003 9.1: 5%)."""
    min_requests: int = 20
    """Outcomes the window needs before its error rate can eject (1 failure in 1 request is not 100%)."""
    max_consecutive_failures: int = 5
    """Eject after this many failures in a row, whatever the window says."""
    cooldown_s: float = 30.0
    """Seconds an ejected replica gets no request before it is probed."""
    max_cooldown_s: float = 300.0
    """Cap of the cooldown, which doubles after each failed probe."""
    enabled: bool = True
    """False: never eject (outcomes are still ignored); for benchmark references."""

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.cooldown_s <= 0:
            raise ValueError(f"window_s and cooldown_s must be > 0, got {self.window_s} and {self.cooldown_s}")
        if not 0.0 <= self.max_error_rate < 1.0:
            raise ValueError(f"max_error_rate must be in [0, 1), got {self.max_error_rate}")
        if self.min_requests < 1 or self.max_consecutive_failures < 1:
            raise ValueError(f"min_requests and max_consecutive_failures must be >= 1, got {self.min_requests} "
                             f"and {self.max_consecutive_failures}")
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError(f"max_cooldown_s ({self.max_cooldown_s}) must be >= cooldown_s ({self.cooldown_s})")


@dataclass(frozen=True)
class Transition:
    """A change of a replica's breaker state caused by one outcome."""

    replica: str
    state: str
    """The new state: :data:`OPEN` (ejected) or :data:`CLOSED` (restored after a probe)."""
    reason: str = ""
    """For an ejection: one of :data:`EJECTION_REASONS`."""
    failures: int = 0
    requests: int = 0
    """Failures and outcomes in the window when it was ejected (the probe alone for ``probe_failed``)."""


@dataclass
class _Replica:
    state: str = CLOSED
    outcomes: deque = field(default_factory=deque)  # (monotonic time, ok)
    num_failures: int = 0
    """Failures among ``outcomes`` (kept with them: summing the window per request cost O(window) at high rates)."""
    consecutive_failures: int = 0
    opened_at: float = 0.0
    cooldown_s: float = 0.0
    probing: bool = False


class CircuitBreaker:
    """Per-replica circuit breakers (module docstring). Not thread-safe: the router's event loop owns it.

    Args:
        config: thresholds and cooldowns.
        clock: monotonic seconds (tests pass a fake clock).
    """

    def __init__(self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or BreakerConfig()
        self.clock = clock
        self._replicas: dict[str, _Replica] = {}

    def state(self, name: str) -> str:
        """The replica's state now (an open breaker whose cooldown ended reads :data:`HALF_OPEN`)."""
        entry = self._replicas.get(name)
        if entry is None:
            return CLOSED
        self._advance(entry)
        return entry.state

    def ejected(self) -> frozenset[str]:
        """Replicas no request may be planned on now: open ones, and half-open ones whose probe is in flight."""
        out = []
        for name, entry in self._replicas.items():
            self._advance(entry)
            if entry.state == OPEN or (entry.state == HALF_OPEN and entry.probing):
                out.append(name)
        return frozenset(out)

    def attempt(self, name: str) -> None:
        """An attempt on ``name`` starts: a half-open replica's attempt is its probe (no second one meanwhile)."""
        entry = self._replicas.get(name)
        if entry is not None:
            self._advance(entry)
            if entry.state == HALF_OPEN:
                entry.probing = True

    def release(self, name: str) -> None:
        """An attempt on ``name`` ended without an outcome (the client went away): a probe may be sent again."""
        entry = self._replicas.get(name)
        if entry is not None:
            entry.probing = False

    def record(self, name: str, ok: bool) -> Transition | None:
        """The outcome of an attempt on ``name`` (``ok``: answered below 500 and, streamed, not broken).

        Returns:
            The transition it caused (ejected or restored), else None.
        """
        c = self.config
        if not c.enabled:
            return None
        entry = self._replicas.setdefault(name, _Replica())
        now = self.clock()
        self._advance(entry)
        if entry.state == OPEN:  # an attempt planned before the ejection finished late: nothing to learn
            return None
        if entry.state == HALF_OPEN:
            entry.probing = False
            if ok:
                self._replicas[name] = _Replica()
                return Transition(name, CLOSED)
            self._open(entry, now, min(entry.cooldown_s * 2, c.max_cooldown_s))
            return Transition(name, OPEN, "probe_failed", failures=1, requests=1)
        entry.outcomes.append((now, ok))
        entry.num_failures += not ok
        while entry.outcomes and entry.outcomes[0][0] <= now - c.window_s:
            entry.num_failures -= not entry.outcomes.popleft()[1]
        entry.consecutive_failures = 0 if ok else entry.consecutive_failures + 1
        requests = len(entry.outcomes)
        failures = entry.num_failures
        if entry.consecutive_failures >= c.max_consecutive_failures:
            reason = "consecutive_failures"
        elif requests >= c.min_requests and failures / requests > c.max_error_rate:
            reason = "error_rate"
        else:
            return None
        self._open(entry, now, c.cooldown_s)
        return Transition(name, OPEN, reason, failures=failures, requests=requests)

    def _open(self, entry: _Replica, now: float, cooldown_s: float) -> None:
        entry.state, entry.opened_at, entry.cooldown_s = OPEN, now, cooldown_s
        entry.outcomes.clear()
        entry.num_failures = 0
        entry.consecutive_failures = 0
        entry.probing = False

    def _advance(self, entry: _Replica) -> None:
        if entry.state == OPEN and self.clock() >= entry.opened_at + entry.cooldown_s:
            entry.state = HALF_OPEN

    def forget(self, keep: set[str]) -> None:
        """Drop the state of replicas no longer in the routing table (names not in ``keep``)."""
        for name in [n for n in self._replicas if n not in keep]:
            del self._replicas[name]
