"""The metric source interface both implementations follow."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.signals import Scope, SignalSet


class MetricSourceError(RuntimeError):
    """The source could not be read (Prometheus unreachable, query rejected)."""


class MetricSource(abc.ABC):
    """Computes ``SignalSet``s for pools and tracks over a trailing window.

    ``refresh`` is called once per poll with the known replica endpoints (the direct-scrape
    source scrapes them; Prometheus scrapes on its own and ignores the call). ``signals``
    evaluates every signal of ``SIGNAL_SPECS`` for a scope over ``(at_s - window_s, at_s]``.
    """

    name: str = "abstract"

    def refresh(self, endpoints: Sequence[ReplicaEndpoint], now_s: float) -> None:  # noqa: B027
        """Collect fresh samples (default: nothing to do)."""

    @abc.abstractmethod
    def signals(self, scope: Scope, *, window_s: float, at_s: float) -> SignalSet:
        """Signals of ``scope``; raises ``MetricSourceError`` when the backing system fails."""

    def kv_transfers(self, scope: Scope, *, window_s: float, at_s: float) -> dict:
        """KV transfers/s by direction, outcome and reason and wire bytes/s by direction
        (:func:`apps.telemetry.signals.kv_transfer_breakdown`); raises ``MetricSourceError``."""
        return {"transfers": [], "wire_bytes_per_s": {}}

    def close(self) -> None:  # noqa: B027
        """Release connections (default: nothing)."""
