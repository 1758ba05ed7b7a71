"""The KV events log and NDJSON stream (torch-free): sequence numbers, gaps, snapshots, batches."""

import asyncio
import json

import pytest

from inference_worker.engine.kv_events import AllCleared, BlockRemoved, BlockStored, KVEventQueue
from inference_worker.server import kv_events
from inference_worker.server.kv_events import KVEventLog, stream_kv_events

D = [bytes([i]) * 32 for i in range(8)]


def stored(i):
    return BlockStored(D[i], D[i - 1] if i else D[7], "full_attention")


def test_log_numbers_events_and_detects_gaps_and_foreign_numbering():
    log = KVEventLog(max_retained=4)
    assert log.seq == 0 and log.since(0) == []
    assert log.extend([stored(0), stored(1), BlockRemoved(D[0], "sliding_attention")]) == 3
    assert log.since(1) == [stored(1).as_dict(), {"type": "removed", "digest": D[0].hex(),
                                                  "group": "sliding_attention", "tier": "device"}]
    assert log.since(3) == []
    assert log.since(4) is None  # ahead of this log: another process's numbering
    log.extend([stored(2), stored(3), AllCleared()])  # 6 events, 4 retained: 3..6
    assert log.since(1) is None  # event 2 was dropped: a gap
    assert log.since(2) == [e.as_dict() for e in (BlockRemoved(D[0], "sliding_attention"), stored(2), stored(3))] \
        + [{"type": "cleared"}]


def test_since_indexes_the_retained_window_exactly_at_its_boundaries():
    log = KVEventLog(max_retained=5)
    log.extend([stored(i % 8) for i in range(12)])  # events 1..12, retained 8..12
    want = {n: stored((n - 1) % 8).as_dict() for n in range(8, 13)}
    assert log.since(6) is None  # event 7 dropped: a gap
    assert log.since(7) == [want[n] for n in range(8, 13)]  # exactly from the first retained
    assert log.since(8) == [want[n] for n in range(9, 13)]
    assert log.since(11) == [want[12]]  # only the last
    assert log.since(12) == []  # caught up
    assert log.since(13) is None  # ahead


def test_batch_line_format_and_counters():
    log = KVEventLog()
    line = log.batch(7, [{"type": "cleared"}], snapshot=True)
    assert line.endswith(b"\n") and json.loads(line) == {"worker_id": log.worker_id, "seq": 7, "snapshot": True,
                                                         "events": [{"type": "cleared"}]}
    assert (log.num_events, log.num_bytes) == (1, len(line))


def test_event_queue_is_bounded_and_counts_drops():
    queue = KVEventQueue(max_events=2)
    for i in range(3):
        queue.put(stored(i))
    assert queue.take() == [stored(1), stored(2)] and queue.num_dropped == 1 and queue.take() == []


async def collect(log, after, num_lines, produce=None, monkeypatch=None):
    calls = []

    async def snapshot():
        calls.append(log.seq)
        return log.seq, [{"type": "cleared"}]

    async def disconnected():
        return False

    lines = []
    stream = stream_kv_events(log, after, snapshot, disconnected)
    async for line in stream:
        lines.append(json.loads(line))
        if produce is not None and len(lines) == 1:
            produce()
        if len(lines) == num_lines:
            break
    await stream.aclose()
    return lines, calls


@pytest.mark.parametrize(("after", "snapshot_first"), [(None, True), (2, False), (50, True)])
def test_stream_starts_with_a_snapshot_only_when_needed_then_sends_batches(monkeypatch, after, snapshot_first):
    monkeypatch.setattr(kv_events, "POLL_S", 0.001)
    log = KVEventLog()
    log.extend([stored(0), stored(1), stored(2)])
    lines, calls = asyncio.run(collect(log, after, 2, produce=lambda: log.extend([stored(3), stored(4)])))
    if snapshot_first:
        assert lines[0] == {"worker_id": log.worker_id, "seq": 3, "snapshot": True, "events": [{"type": "cleared"}]}
        assert calls == [3]
    else:
        assert lines[0]["seq"] == 3 and lines[0]["events"] == [stored(2).as_dict()] and calls == []
    assert lines[1] == {"worker_id": log.worker_id, "seq": 5, "snapshot": False,
                        "events": [stored(3).as_dict(), stored(4).as_dict()]}


def test_stream_sends_heartbeats_when_idle(monkeypatch):
    monkeypatch.setattr(kv_events, "POLL_S", 0.001)
    monkeypatch.setattr(kv_events, "HEARTBEAT_S", 0.0)
    log = KVEventLog()
    log.extend([stored(0)])
    lines, _ = asyncio.run(collect(log, 1, 2))
    assert [(line["seq"], line["events"]) for line in lines] == [(1, []), (1, [])]
