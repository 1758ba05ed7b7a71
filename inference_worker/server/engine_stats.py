"""What the engine loop publishes to the worker metrics: busy ratio, queue depth, KV usage, prefix cache, KV events.

The busy ratio is the fraction of wall time inside ``step()`` over the last :data:`BUSY_WINDOW_S`
seconds (the CPU substitute for GPU utilization). Everything is published at most every
:data:`STATS_INTERVAL_S` seconds, from the engine thread.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from inference_worker.metrics import WorkerMetrics
from inference_worker.server.kv_events import KVEventLog

BUSY_WINDOW_S = 5.0
STATS_INTERVAL_S = 0.25


class EngineStats:
    """Busy-time bookkeeping and metric publishing for one engine loop (engine thread only).

    Args:
        engine: the engine (read through its public accessors).
        metrics: where to publish (None: nothing is published, the busy ratio is still tracked).
        kv_events: the loop's KV event log (events and bytes served are counted from it).
    """

    def __init__(self, engine: Any, metrics: WorkerMetrics | None, kv_events: KVEventLog) -> None:
        self.engine = engine
        self.metrics = metrics
        self.kv_events = kv_events
        self.busy_ratio = 0.0
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque()
        self._interval_start = time.monotonic()
        self._interval_busy = 0.0
        self._last = 0.0
        self._prefix_stats: dict[str, Any] = {}
        self._kv_events_published = (0, 0, 0)

    def add_busy(self, seconds: float) -> None:
        """Count ``seconds`` spent in ``step()``."""
        self._interval_busy += seconds

    def maybe_publish(self) -> None:
        """Update the busy ratio and publish, unless the last publish was under ``STATS_INTERVAL_S`` ago."""
        now = time.monotonic()
        if now - self._last < STATS_INTERVAL_S:
            return
        self._last = now
        self._samples.append((self._interval_start, now, self._interval_busy))
        self._interval_start, self._interval_busy = now, 0.0
        while self._samples and self._samples[0][1] < now - BUSY_WINDOW_S:
            self._samples.popleft()
        span = now - self._samples[0][0]
        self.busy_ratio = min(1.0, sum(s[2] for s in self._samples) / span) if span > 0 else 0.0
        if self.metrics is None:
            return
        waiting, running, kv_usage = engine_queue_stats(self.engine)
        self.metrics.set_engine_state(num_waiting=waiting, num_running=running, kv_cache_usage=kv_usage,
                                      busy_ratio=self.busy_ratio)
        stats = getattr(self.engine, "prefix_cache_stats", None)
        if stats is not None:
            current = stats()
            self.metrics.prefix_cache(current, self._prefix_stats)
            self._prefix_stats = current
        published = (self.kv_events.seq, self.kv_events.num_events, self.kv_events.num_bytes)
        self.metrics.kv_events(*(now - before for now, before in zip(published, self._kv_events_published,
                                                                     strict=True)))
        self._kv_events_published = published


def engine_queue_stats(engine: Any) -> tuple[int, int, float | None]:
    """(num_waiting, num_running, KV cache usage 0..1 or None) from the engine's read-only accessors.

    Queue depth comes from ``engine.num_waiting`` / ``engine.num_running``. KV usage is
    ``engine.kv_cache_usage`` when the engine has it (paged cache: blocks in use); for the
    contiguous cache it is the fraction of per-sequence KV slots in use; None if neither exists.
    """
    usage = getattr(engine, "kv_cache_usage", None)
    runner = getattr(engine, "runner", None)
    if usage is None and hasattr(runner, "num_free_slots") and hasattr(runner, "max_num_seqs"):
        usage = 1.0 - runner.num_free_slots / runner.max_num_seqs
    return int(engine.num_waiting), int(engine.num_running), None if usage is None else float(usage)
