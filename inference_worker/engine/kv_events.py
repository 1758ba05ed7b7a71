"""KV cache events: what the prefix cache publishes (blocks stored, blocks removed, all cleared); torch-free.

The KV cache manager appends events to one :class:`KVEventQueue` as blocks are registered in a
group's cached-block map, evicted from it, or the whole cache is reset; the engine drains the
queue and the worker serves them (``GET /v1/kv-events``, :mod:`inference_worker.server.kv_events`).
Digests are :mod:`inference_worker.engine.block_hash` digests; ``group`` is the KV-cache group's
attention type (``full_attention`` / ``sliding_attention``); ``tier`` is where the block lives
(``"device"``: the engine's KV tensors; later tiers add ``"host"``, ``"disk"``, ``"shared"``).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

DEVICE_TIER = "device"
TIERS = (DEVICE_TIER, "host", "disk", "shared")


@dataclass(frozen=True)
class BlockStored:
    """A block became reusable: its KV is complete for the tokens its digest names."""

    digest: bytes
    parent_digest: bytes
    group: str
    tier: str = DEVICE_TIER

    def as_dict(self) -> dict:
        """JSON form: ``{"type": "stored", "digest": hex, "parent": hex, "group": ..., "tier": ...}``."""
        return {"type": "stored", "digest": self.digest.hex(), "parent": self.parent_digest.hex(),
                "group": self.group, "tier": self.tier}


@dataclass(frozen=True)
class BlockRemoved:
    """A block's memory was reused (evicted): its digest no longer hits in that group and tier."""

    digest: bytes
    group: str
    tier: str = DEVICE_TIER

    def as_dict(self) -> dict:
        """JSON form: ``{"type": "removed", "digest": hex, "group": ..., "tier": ...}``."""
        return {"type": "removed", "digest": self.digest.hex(), "group": self.group, "tier": self.tier}


@dataclass(frozen=True)
class AllCleared:
    """Every cached block of every group and tier was forgotten (prefix cache reset)."""

    def as_dict(self) -> dict:
        """JSON form: ``{"type": "cleared"}``."""
        return {"type": "cleared"}


KVEvent = BlockStored | BlockRemoved | AllCleared


class KVEventQueue:
    """Events not yet taken by the engine, bounded: past ``max_events`` the oldest are dropped.

    Dropping is safe because consumers re-synchronise from a snapshot (a gap in sequence numbers
    is detected downstream); ``num_dropped`` counts them. Thread-safe: the KV tiers' writer thread puts
    tier events while the engine thread puts and takes.
    """

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self.num_dropped = 0

    def put(self, event: KVEvent) -> None:
        """Append one event (O(1))."""
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.num_dropped += 1
            self._events.append(event)

    def take(self) -> list[KVEvent]:
        """Remove and return every queued event, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events
