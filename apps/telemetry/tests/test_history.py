"""The Redis signal history: exact reads across compressed chunks, trimming at the horizon, the seal racing
another writer, bulk loads, and what the full 15-minute horizon of poller-shaped records costs."""

from __future__ import annotations

import json
import random

import pytest
import redis

from apps.telemetry.history import SignalHistory
from apps.telemetry.signals import SIGNAL_SPECS

T0 = 1_780_000_000.0


def record(i: int, *, scope: str = "pool:1") -> dict:
    return {"type": "telemetry.signals", "seq": i + 1, "at": T0 + i, "scope": scope,
            "signals": {"request_rate_per_s": i / 7, "ttft_p99_s": None, "ready_replicas": 2.0}}


@pytest.fixture
def small(history):
    """The test's history with chunks of 4 records (3 sealed at a time), so a few appends cross chunk edges."""
    return SignalHistory(history.client, prefix=history.prefix, chunk_records=4)


def test_reads_return_exactly_the_appended_records_in_time_order_across_chunks(small):
    for i in range(11):
        small.append("pool:1", T0 + i, record(i))
    recent, chunks = small.history_keys("pool:1")
    # 11 appends with chunks of 4: seals after append 4, 7 and 10 (3 records each), 2 records left in the list
    assert (small.client.llen(recent), small.client.zcard(chunks)) == (2, 3)
    assert small.read("pool:1") == [record(i) for i in range(11)]
    assert small.read("pool:1", since_s=T0 + 2, until_s=T0 + 8) == [record(i) for i in range(2, 9)]
    assert small.read("pool:1", since_s=T0 + 9.5) == [record(10)]
    assert small.read("pool:1", until_s=T0 + 0.5) == [record(0)]
    assert small.latest("pool:1") == record(10)
    assert small.read("pool:2") == [] and small.latest("pool:2") is None


def test_read_many_and_latest_many_keep_scopes_apart(small):
    for i in range(9):
        small.append("pool:1", T0 + i, record(i))
        small.append("fleet", T0 + i, record(i, scope="fleet"))
    assert small.read_many(["pool:1", "fleet", "pool:9"], since_s=T0 + 5) == {
        "pool:1": [record(i) for i in range(5, 9)],
        "fleet": [record(i, scope="fleet") for i in range(5, 9)],
        "pool:9": [],
    }
    assert small.latest_many(["fleet", "pool:1", "pool:9"]) == {
        "fleet": record(8, scope="fleet"), "pool:1": record(8), "pool:9": None}


def test_only_the_horizon_of_the_newest_append_is_kept_and_read(history):
    h = SignalHistory(history.client, prefix=history.prefix, horizon_s=10.0, chunk_records=4)
    for i in range(25):
        h.append("pool:1", T0 + i, record(i))
    # newest 24: the horizon is [14, 24]; chunks whose newest record is older than 14 are deleted
    assert h.read("pool:1") == [record(i) for i in range(14, 25)]
    blobs = h.client.zrange(h.history_keys("pool:1")[1], 0, -1, withscores=True)
    assert [score - T0 for _, score in blobs] == [14.0, 17.0, 20.0, 23.0]
    # a jump ahead leaves only the new record, as the per-record trimming did
    h.append("pool:1", T0 + 1000, record(1000))
    assert h.read("pool:1") == [record(1000)]
    assert h.client.zcard(h.history_keys("pool:1")[1]) == 0


def test_replace_keeps_only_the_newest_record_of_a_scope(small):
    for i in range(9):
        small.replace("fleet", T0 + i, record(i, scope="fleet"))
    assert small.read("fleet") == [record(8, scope="fleet")]
    assert small.latest("fleet") == record(8, scope="fleet")
    recent, chunks = small.history_keys("fleet")
    assert (small.client.llen(recent), small.client.exists(chunks)) == (1, 0)


def test_out_of_order_and_equal_times_read_in_time_then_append_order(small):
    times = [5.0, 3.0, 4.0, 4.0, 1.0, 6.0, 2.0]
    for n, t in enumerate(times):
        small.append("pool:1", T0 + t, {"n": n})
    assert small.read("pool:1") == [{"n": n} for n in (4, 6, 1, 2, 3, 0, 5)]
    assert small.latest("pool:1") == {"n": 6}  # the last appended


def test_a_seal_racing_another_writer_loses_and_doubles_nothing(small, monkeypatch):
    for i in range(3):
        small.append("pool:1", T0 + i, record(i))
    real_lrange = redis.client.Pipeline.lrange
    raced = []

    def lrange_then_another_writer_appends(pipe, name, start, end):
        found = real_lrange(pipe, name, start, end)
        if not raced:  # between the seal's WATCH + LRANGE and its EXEC, once
            raced.append(name)
            small.client.rpush(name, json.dumps([T0 + 3.5, record(35)], sort_keys=True, separators=(",", ":")))
        return found

    monkeypatch.setattr(redis.client.Pipeline, "lrange", lrange_then_another_writer_appends)
    small.append("pool:1", T0 + 3, record(3))  # the 4th member: seals, loses the race once, seals again
    for i in range(4, 6):
        small.append("pool:1", T0 + i, record(i))
    assert raced == [small.history_keys("pool:1")[0]]
    assert small.read("pool:1") == [record(0), record(1), record(2), record(3), record(35), record(4), record(5)]
    recent, chunks = small.history_keys("pool:1")
    assert (small.client.llen(recent), small.client.zcard(chunks)) == (3, 1)  # [35, 4, 5] and one chunk of 0-3


def test_append_many_stores_full_chunks_and_reads_back_exactly(small):
    rows = [(scope, T0 + i, record(i, scope=scope)) for i in range(10) for scope in ("pool:1", "pool:2")]
    assert small.append_many(rows) == 20
    for scope in ("pool:1", "pool:2"):
        recent, chunks = small.history_keys(scope)
        assert (small.client.llen(recent), small.client.zcard(chunks)) == (1, 3)  # 4 + 4 + 1 sealed, 1 recent
        assert small.read(scope) == [record(i, scope=scope) for i in range(10)]
        assert small.latest(scope) == record(9, scope=scope)
    small.append("pool:1", T0 + 10, record(10))  # live appends continue after a bulk load
    assert small.read("pool:1", since_s=T0 + 8) == [record(8), record(9), record(10)]


def poller_shaped_record(i: int, rng: random.Random, pool_id: int) -> dict:
    """A pool record as the poller writes it: every signal for the pool and its one track (the same values,
    as a one-track pool's are), KV transfers, ejections; rates and quantiles change at most polls."""
    signals = {name: (None if name.startswith(("gpu_", "error_rate")) else round(rng.random() * 50, 12)
                      if i % 3 else 0.0) for name in SIGNAL_SPECS}
    signals["ready_replicas"] = 1.0
    return {"type": "telemetry.signals", "seq": i + 1, "pool_id": pool_id, "at": T0 + i, "window_s": 30.0,
            "source": "scrape", "signals": signals, "tracks": {"stable": dict(signals)},
            "kv_transfers": {"transfers": [{"direction": "send", "outcome": "ok", "reason": "",
                                            "per_s": signals["request_rate_per_s"]}],
                             "wire_bytes_per_s": {"send": signals["kv_transfer_bytes_per_s"]}},
            "ejections": {}}


def test_the_full_horizon_costs_a_fraction_of_one_sorted_set_member_per_record(history):
    """900 polls (15 minutes at 1 s) of one pool with ~24 changing floats per record, not thinned: the chunks cost
    under a quarter of the per-record sorted set they replace, and every record reads back exactly."""
    history = SignalHistory(history.client, prefix=history.prefix, thin_after_s=None)
    rng = random.Random(7)
    records = [poller_shaped_record(i, rng, 1) for i in range(900)]
    for i, rec in enumerate(records):
        history.append("pool:1", T0 + i, rec)
    assert history.read("pool:1") == records
    compact = history.memory_bytes(["pool:1"])
    per_record = f"{history.prefix}per-record"
    for i, rec in enumerate(records):
        history.client.zadd(per_record, {json.dumps(rec, sort_keys=True, separators=(",", ":")): T0 + i})
    before = history.client.memory_usage(per_record, samples=0)
    print(f"\nfull horizon of one pool: {compact / 1024:.1f} KiB in chunks, {before / 1024:.1f} KiB as one "
          f"sorted-set member per record ({before / compact:.1f}x)")
    assert compact * 4 < before


def test_records_older_than_the_full_resolution_span_are_thinned_to_one_per_bucket_and_none_is_lost(history):
    """At 1 record per second with chunks of 4 (sealed 3 at a time), thinning after 10 s to one per 5 s: every
    record of chunks not yet 10 s behind reads back, older chunks keep the first record of each 5-s bucket they
    held (a bucket that had records keeps one), reads by time see the same, and the horizon still trims."""
    h = SignalHistory(history.client, prefix=history.prefix, horizon_s=60.0, chunk_records=4, thin_after_s=10.0,
                      thin_every_s=5.0)
    records = [record(i) for i in range(50)]
    for i, rec in enumerate(records):
        h.append("pool:1", T0 + i, rec)
    recent, chunks = h.history_keys("pool:1")
    members = h.client.zrange(chunks, 0, -1, withscores=True)
    thinned = [score - T0 for blob, score in members if blob[:1] == b"T"]
    full = [score - T0 for blob, score in members if blob[:1] != b"T"]
    # seals at the appends of t = 3, 6, ..., 48 (chunks ending at 2, 5, ..., 47); the last seal (t = 48) thinned
    # the chunks ending before 38; the horizon (60 s) keeps everything
    assert thinned == [2.0, 5.0, 8.0, 11.0, 14.0, 17.0, 20.0, 23.0, 26.0, 29.0, 32.0, 35.0]
    assert full == [38.0, 41.0, 44.0, 47.0] and h.client.llen(recent) == 2
    read = [r["at"] - T0 for r in h.read("pool:1")]
    kept_old = [t for t in read if t <= 35]
    expected_old = []  # chunk [0, 1, 2] keeps 0 (bucket 0); [3, 4, 5] keeps 3 and 5 (buckets 0 and 1); ...
    for start in range(0, 36, 3):
        bucket = None
        for t in range(start, start + 3):
            if t // 5 != bucket:
                expected_old.append(float(t))
                bucket = t // 5
    assert kept_old == expected_old
    assert {t // 5 for t in kept_old} == {t // 5 for t in range(36)}  # no 5-s bucket lost
    assert read[len(kept_old):] == [float(t) for t in range(36, 50)]  # full resolution after
    assert h.read("pool:1", since_s=T0 + 20, until_s=T0 + 30) == [records[int(t)] for t in expected_old
                                                                    if 20 <= t <= 30]
    assert h.latest("pool:1") == records[49]
    for i in range(50, 120):  # the horizon trims thinned chunks like the others
        h.append("pool:1", T0 + i, record(i))
    assert h.read("pool:1")[0]["at"] - T0 >= 119 - 60
