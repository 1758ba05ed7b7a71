"""The router policies the simulator compares: where a prompt of ``N`` tokens prefills.

- :class:`HomogeneousPD`: prefill and decode in one datacenter on one accelerator type; always local.
- :class:`NaiveHeterogeneous`: every prefill remote (compute datacenter), decode local.
- :class:`FixedThreshold`: remote iff ``N > T``.
- :class:`BandwidthAware`: ``N <= low`` local, ``N > high`` remote (its KV drains the link budget
  without being gated by it); in between, remote iff the link
  budget allows it (a token bucket filled at ``max_link_share * B`` bytes/s, one second deep, that
  every remote decision drains by its KV bytes and may overdraw once: the long-run link share stays
  under ``max_link_share`` plus the bucket's depth over the run; a measured-utilisation gate lags by a
  prefill time and overshot to 43% in a test) and the estimated remote finish
  (remote queue wait + remote prefill + transfer at the link's current processor-sharing rate + RTT)
  beats the local one (local queue wait + local prefill): the DESIGN's PD cost function with live link
  load and queue waits. The effective threshold is the smallest ``N`` it sends remote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class SystemView(Protocol):
    """What a policy may read from the system at decision time."""

    def local_wait_s(self) -> float: ...
    def remote_wait_s(self) -> float: ...
    def local_prefill_s(self, num_tokens: int) -> float: ...
    def remote_prefill_s(self, num_tokens: int) -> float: ...
    def transfer_eta_s(self, num_tokens: int) -> float: ...
    def link_budget_allows(self, num_tokens: int) -> bool: ...
    def link_budget_spend(self, num_tokens: int) -> None: ...


class Policy(Protocol):
    """A routing policy: ``remote(num_tokens, view)`` is True to prefill remotely."""

    name: str

    def remote(self, num_tokens: int, view: SystemView) -> bool: ...


@dataclass(frozen=True)
class HomogeneousPD:
    name: str = "homogeneous_pd"

    def remote(self, num_tokens: int, view: SystemView) -> bool:
        """Never remote."""
        return False


@dataclass(frozen=True)
class NaiveHeterogeneous:
    name: str = "naive_heterogeneous"

    def remote(self, num_tokens: int, view: SystemView) -> bool:
        """Always remote."""
        return True


@dataclass(frozen=True)
class FixedThreshold:
    threshold_tokens: int
    """Remote iff the prompt has more tokens."""
    name: str = "fixed_threshold"

    def remote(self, num_tokens: int, view: SystemView) -> bool:
        """``num_tokens > threshold_tokens``."""
        return num_tokens > self.threshold_tokens


@dataclass(frozen=True)
class BandwidthAware:
    low_tokens: int
    """At or below: always local."""
    high_tokens: int
    """Above: always remote."""
    max_link_share: float
    """Link share the router's link budget refills at (reported; the view's bucket enforces it)."""
    name: str = "bandwidth_aware"

    def remote(self, num_tokens: int, view: SystemView) -> bool:
        """See the module docstring."""
        if num_tokens <= self.low_tokens:
            return False
        if num_tokens > self.high_tokens:
            view.link_budget_spend(num_tokens)  # forced remote: its KV counts against the link budget too
            return True
        local = view.local_wait_s() + view.local_prefill_s(num_tokens)
        remote = view.remote_wait_s() + view.remote_prefill_s(num_tokens) + view.transfer_eta_s(num_tokens)
        return remote < local and view.link_budget_allows(num_tokens)
