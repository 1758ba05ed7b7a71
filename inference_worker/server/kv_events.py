"""KV cache events of one worker, served as newline-delimited JSON on ``GET /v1/kv-events``.

The router's prefix index consumes this stream (cache-aware routing); this module owns the format.

**Stream.** ``GET /v1/kv-events?after=SEQ`` answers ``200`` with ``Content-Type:
application/x-ndjson``; every line is one JSON object, a *batch*::

    {"worker_id": "<hex>", "seq": 42, "snapshot": false, "events": [<event>, ...]}

Events carry consecutive per-worker sequence numbers; ``seq`` is the number of the batch's *last*
event, so a batch of ``k`` events holds numbers ``seq-k+1 .. seq``. An empty ``events`` list is a
heartbeat (every :data:`HEARTBEAT_S` seconds) that repeats the current ``seq``. ``worker_id`` is
random per worker process: when it changes, sequence numbers restarted.

**Snapshot.** The first batch is a snapshot (``"snapshot": true``) when ``after`` is absent, when
events after ``after`` are no longer retained (a gap: the log keeps the last
:data:`MAX_RETAINED_EVENTS`), or when ``after`` is ahead of the worker (the worker restarted). A
snapshot's events are ``{"type": "cleared"}`` followed by one ``stored`` event per block cached now,
and its ``seq`` is the number of the last event it includes: apply it by clearing your index,
storing its blocks, and continuing with the batches that follow (numbers ``seq+1`` onwards).
Otherwise the stream starts with the retained events numbered ``after+1`` onwards.

**Events** (``inference_worker.engine.kv_events``)::

    {"type": "stored", "digest": hex, "parent": hex, "group": "full_attention"|"sliding_attention", "tier": "device"}
    {"type": "removed", "digest": hex, "group": ..., "tier": "device"}
    {"type": "cleared"}

``digest``/``parent`` are the 32-byte block digests of ``inference_worker.engine.block_hash`` (a block
0's parent is the root, salted with the weights sha256, KV dtype and block size). A prefix of a
prompt is cached on this worker for the hybrid hit rule when every group has the blocks the rule
needs (``block_hash.longest_hit_blocks``). Events are batched: the engine thread appends each step's
events at once and the stream sends what accumulated every :data:`POLL_S` seconds.

Data-plane only: this is plain HTTP from the worker; nothing goes through the control plane's Redis.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

MAX_RETAINED_EVENTS = 65_536
POLL_S = 0.05
HEARTBEAT_S = 15.0
NDJSON = "application/x-ndjson"


class KVEventLog:
    """Sequence-numbered KV events kept in memory (bounded), appended by the engine thread.

    Thread-safe: :meth:`extend` runs on the engine thread, :meth:`since` on the event loop.
    """

    def __init__(self, max_retained: int = MAX_RETAINED_EVENTS) -> None:
        self.worker_id = secrets.token_hex(8)
        self._events: collections.deque[tuple[int, dict]] = collections.deque(maxlen=max_retained)
        self._seq = 0
        self._lock = threading.Lock()
        self.num_events = 0
        self.num_bytes = 0

    @property
    def seq(self) -> int:
        """Number of the last event appended (0: none yet)."""
        return self._seq

    def extend(self, events: list[Any]) -> int:
        """Append engine events (objects with ``as_dict()``); returns the new last sequence number."""
        with self._lock:
            for event in events:
                self._seq += 1
                self._events.append((self._seq, event.as_dict()))
            return self._seq

    def since(self, after: int) -> list[dict] | None:
        """Retained events numbered ``after+1 .. seq`` as dicts, or None if some were dropped (a gap)
        or ``after`` is ahead of this log (another process's numbering)."""
        with self._lock:
            if after > self._seq:
                return None
            if after == self._seq:
                return []
            if not self._events or self._events[0][0] > after + 1:
                return None
            # numbers are contiguous, so the wanted events are the last seq-after ones: walk them from the
            # tail (O(events returned); a streaming client asks for the few newest, not a copy of 65536)
            tail = itertools.islice(reversed(self._events), self._seq - after)
            return [event for _, event in tail][::-1]

    def batch(self, seq: int, events: list[dict], *, snapshot: bool = False) -> bytes:
        """One NDJSON line (counted in ``num_events`` / ``num_bytes``)."""
        line = json.dumps({"worker_id": self.worker_id, "seq": seq, "snapshot": snapshot, "events": events},
                          separators=(",", ":")).encode() + b"\n"
        self.num_events += len(events)
        self.num_bytes += len(line)
        return line


async def stream_kv_events(log: KVEventLog, after: int | None,
                           snapshot: Callable[[], Awaitable[tuple[int, list[dict]]]],
                           is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
    """The NDJSON body of ``GET /v1/kv-events`` (format in the module docstring).

    Args:
        after: the client's last applied sequence number, or None.
        snapshot: coroutine giving ``(seq, events)`` of the cache now (taken on the engine thread).
        is_disconnected: ends the stream when the client is gone.
    """
    pending = None if after is None else log.since(after)
    if pending is None:
        seq, events = await snapshot()
        yield log.batch(seq, events, snapshot=True)
        pending = log.since(seq) or []
    else:
        seq = after
    loop = asyncio.get_running_loop()
    last_sent = loop.time()
    while True:
        if pending:
            seq += len(pending)
            yield log.batch(seq, pending)
            last_sent = loop.time()
        elif loop.time() - last_sent >= HEARTBEAT_S:
            yield log.batch(seq, [])
            last_sent = loop.time()
        await asyncio.sleep(POLL_S)
        if await is_disconnected():
            return
        pending = log.since(seq)
        if pending is None:  # fell behind the retained window: start over from a snapshot
            seq, events = await snapshot()
            yield log.batch(seq, events, snapshot=True)
            pending = log.since(seq) or []
