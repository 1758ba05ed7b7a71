"""Counting KV transfers by direction, outcome and reason, into the worker's Prometheus metrics.

The series are defined in :mod:`inference_worker.metrics` (``ferry_kv_transfer_total``,
``..._raw_bytes_total``, ``..._wire_bytes_total``, ``..._seconds``); this module only increments
them, and keeps an in-process tally (``counts``) that benchmarks and tests read without scraping.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from inference_worker.metrics import WORKER_LABELS, KVTransferMetrics

SEND, RECEIVE = "send", "receive"


class TransferRecorder:
    """Records transfer outcomes.

    Args:
        metrics: the worker's :class:`~inference_worker.metrics.KVTransferMetrics` (``WorkerMetrics.kv_transfer``),
            or None to keep only the in-process tally.
        identity: the worker's label values (``WorkerMetrics.identity``); missing labels become "".
    """

    def __init__(self, metrics: KVTransferMetrics | None = None, identity: Mapping[str, str] | None = None):
        self.metrics = metrics
        self.identity = {name: str((identity or {}).get(name, "")) for name in WORKER_LABELS}
        self.counts: Counter[tuple[str, str, str]] = Counter()
        """``(direction, outcome, reason) -> transfers``."""
        self.dropped: Counter[str] = Counter()
        """``reason -> connections`` the receiver dropped."""
        self.raw_bytes: Counter[str] = Counter()
        self.wire_bytes: Counter[str] = Counter()

    def success(self, direction: str, *, raw_bytes: int, wire_bytes: int, seconds: float) -> None:
        """Count one delivered transfer with its raw (uncompressed KV) and wire (framed) bytes."""
        self.counts[(direction, "success", "none")] += 1
        self.raw_bytes[direction] += raw_bytes
        self.wire_bytes[direction] += wire_bytes
        if self.metrics is not None:
            self.metrics.transfers.labels(**self.identity, direction=direction, outcome="success", reason="none").inc()
            self.metrics.raw_bytes.labels(**self.identity, direction=direction).inc(raw_bytes)
            self.metrics.wire_bytes.labels(**self.identity, direction=direction).inc(wire_bytes)
            self.metrics.seconds.labels(**self.identity, direction=direction).observe(seconds)

    def failure(self, direction: str, reason: str) -> None:
        """Count one failed transfer under ``reason`` (an error class's ``reason``)."""
        self.counts[(direction, "failure", reason)] += 1
        if self.metrics is not None:
            self.metrics.transfers.labels(**self.identity, direction=direction, outcome="failure",
                                          reason=reason).inc()

    def drop(self, reason: str) -> None:
        """Count one receiver connection dropped because the peer lied (its frame is counted by :meth:`failure`)."""
        self.dropped[reason] += 1
        if self.metrics is not None:
            self.metrics.dropped.labels(**self.identity, reason=reason).inc()

    def failures(self, direction: str) -> dict[str, int]:
        """``reason -> count`` of failures in ``direction``."""
        return {r: n for (d, o, r), n in self.counts.items() if d == direction and o == "failure"}
