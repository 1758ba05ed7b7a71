"""The router's prefix index from KV events (issue 18, acceptance 4): snapshots, gaps, restarts, the hybrid
hit rule, the shared tier, dropped replicas, and re-sync over a real HTTP stream."""

import asyncio
import http.server
import json
import threading
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from inference_worker.router.prefix_index import FULL, SLIDING, KVEventSubscriber, PrefixIndex

D = [bytes([k]) * 32 for k in range(8)]
GROUPS = {FULL: None, SLIDING: 4}  # W = 4, block_size 2: a hit of h tokens needs sliding blocks (h-3)//2 ..


def stored(k, group, tier="device"):
    return {"type": "stored", "digest": D[k].hex(), "parent": "", "group": group, "tier": tier}


def removed(k, group):
    return {"type": "removed", "digest": D[k].hex(), "group": group, "tier": "device"}


def snapshot(worker, seq, blocks):
    events = [{"type": "cleared"}] + [stored(k, g) for k in blocks for g in (FULL, SLIDING)]
    assert len(events) == seq
    return {"worker_id": worker, "seq": seq, "snapshot": True, "events": events}


def hit(index, name="r0", num_tokens=15):
    return index.hit_tokens(name, D, num_tokens, GROUPS, 2)


def test_snapshot_then_events_follow_the_hybrid_hit_rule():
    index = PrefixIndex()
    index.retain({"r0": "v1"})
    assert hit(index) == (0, 0.0) and index.after("r0") is None
    assert index.apply("r0", snapshot("w1", 9, [0, 1, 2, 3]))
    assert hit(index) == (8, 8.0) and index.after("r0") == 9
    assert hit(index, num_tokens=8) == (6, 6.0)  # the last prompt token is always computed
    # Sliding block 0 evicted: a hit of 8 reads sliding blocks 2..3 only, still 8.
    assert index.apply("r0", {"worker_id": "w1", "seq": 10, "snapshot": False, "events": [removed(0, SLIDING)]})
    assert hit(index) == (8, 8.0)
    # Sliding block 2 evicted while full block 2 stays: hits of 8 and 6 read it; a hit of 4 reads sliding 0..1.
    events = [stored(0, SLIDING), removed(2, SLIDING)]
    assert index.apply("r0", {"worker_id": "w1", "seq": 12, "snapshot": False, "events": events})
    assert hit(index) == (4, 4.0)
    assert index.apply("r0", {"worker_id": "w1", "seq": 13, "snapshot": False, "events": [removed(0, SLIDING)]})
    assert hit(index) == (0, 0.0)  # a hit of 2 reads positions 0..1: sliding block 0 is gone
    assert index.apply("r0", {"worker_id": "w1", "seq": 13, "snapshot": False, "events": []})  # heartbeat


def test_a_gap_or_a_restart_drops_the_replica_until_a_snapshot_re_syncs_it():
    index = PrefixIndex()
    index.retain({"r0": "v1"})
    index.apply("r0", snapshot("w1", 5, [0, 1]))
    gap = {"worker_id": "w1", "seq": 8, "snapshot": False, "events": [stored(2, FULL)]}  # 6..7 were lost
    assert not index.apply("r0", gap)
    assert hit(index) == (0, 0.0) and index.after("r0") is None and index.replicas["r0"].num_resyncs == 1
    assert index.apply("r0", snapshot("w1", 7, [0, 1, 2]))
    assert hit(index) == (6, 6.0)
    restarted = {"worker_id": "w2", "seq": 8, "snapshot": False, "events": [stored(3, FULL)]}
    assert not index.apply("r0", restarted)
    assert index.after("r0") is None and index.replicas["r0"].num_resyncs == 2
    assert index.apply("r0", snapshot("w2", 1, []))
    assert hit(index) == (0, 0.0) and index.after("r0") == 1


def test_shared_tier_counts_for_every_replica_of_the_version_and_left_replicas_are_dropped():
    index = PrefixIndex()
    index.retain({"r0": "v1", "r1": "v1", "r2": "v2"})
    events = [{"type": "cleared"}] + [stored(k, g, "shared") for k in (0, 1) for g in (FULL, SLIDING)]
    index.apply("r0", {"worker_id": "w", "seq": 5, "snapshot": True, "events": events})
    for name in ("r1", "r2"):
        index.apply(name, snapshot(name, 1, []))
    assert hit(index, "r1") == (4, 4 * 0.4) and hit(index, "r0") == (4, 4 * 0.4)
    assert hit(index, "r2") == (0, 0.0)  # another model version: another store
    index.retain({"r1": "v1"})
    assert set(index.replicas) == {"r1"}
    with pytest.raises(ValueError, match="malformed"):
        index.apply("r1", {"seq": 2})


class ScriptedEvents(http.server.BaseHTTPRequestHandler):
    """Answers each GET /v1/kv-events with the next scripted body (then closes), recording ``after``."""

    script: list[list[dict]] = []
    seen: list[str | None] = []

    def do_GET(self):  # noqa: N802
        after = parse_qs(urlparse(self.path).query).get("after", [None])[0]
        type(self).seen.append(after)
        batches = type(self).script.pop(0) if type(self).script else []
        body = b"".join(json.dumps(b).encode() + b"\n" for b in batches)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_subscriber_re_syncs_after_a_gap_and_a_restart_over_http():
    ScriptedEvents.script = [
        [snapshot("w1", 5, [0, 1]), {"worker_id": "w1", "seq": 7, "snapshot": False,
                                     "events": [stored(2, FULL), stored(2, SLIDING)]}],
        [{"worker_id": "w1", "seq": 10, "snapshot": False, "events": [stored(3, FULL)]}],  # 8..9 lost
        [snapshot("w1", 9, [0, 1, 2, 3])],
        [{"worker_id": "w2", "seq": 12, "snapshot": False, "events": [stored(0, FULL)] * 3}],  # restarted
        [snapshot("w2", 3, [0])],
    ]
    ScriptedEvents.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ScriptedEvents)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    index = PrefixIndex()
    index.retain({"r0": "v1"})
    resyncs = []

    async def follow():
        async with httpx.AsyncClient() as client:
            subscriber = KVEventSubscriber(index, "r0", f"http://127.0.0.1:{server.server_port}", client=client,
                                           retry_s=0.01)
            subscriber.on_resync = resyncs.append
            task = asyncio.create_task(subscriber.run())
            for _ in range(500):
                if not ScriptedEvents.script and index.after("r0") == 3:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(follow())
    finally:
        server.shutdown()
    assert ScriptedEvents.seen[:5] == [None, "7", None, "9", None]
    assert resyncs == ["r0", "r0"] and index.replicas["r0"].worker_id == "w2"
    assert hit(index) == (2, 2.0)


def test_the_feed_follows_the_table_and_drops_replicas_that_leave_it():
    from types import SimpleNamespace

    from inference_worker.router.prefix_index import KVIndexFeed
    from inference_worker.router.table import RoutingTable

    def table(*names):
        return RoutingTable.from_dict({"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
                                       "pools": [{"name": "d", "role": "decode", "replicas": [
                                           {"name": n, "url": "http://127.0.0.1:9", "track": "stable"} for n in names]}]})

    async def scenario():
        source = SimpleNamespace(table=table("r0", "r1"))
        index = PrefixIndex()
        async with httpx.AsyncClient() as client:
            feed = KVIndexFeed(index, source, client=client)
            feed.sync()
            assert set(index.replicas) == set(feed.tasks) == {"r0", "r1"}
            index.apply("r1", snapshot("w", 3, [0]))
            source.table = table("r1", "r2")
            feed.sync()
            await asyncio.sleep(0)
            assert set(index.replicas) == set(feed.tasks) == {"r1", "r2"}
            assert index.after("r1") == 3  # kept: still in the table
            for _, task in feed.tasks.values():
                task.cancel()
            await asyncio.gather(*(t for _, t in feed.tasks.values()), return_exceptions=True)

    asyncio.run(scenario())


def reference_hit_tokens(index, replica, digests, num_tokens, groups, block_size):
    """The lookup as first written (per call: the replica's group dict, else the shared store's), kept as the
    reference the faster lookup must equal."""
    from inference_worker.engine.block_hash import longest_hit_blocks
    from inference_worker.router.prefix_index import TIER_WEIGHTS

    state = index.replicas.get(replica)
    if state is None or state.seq is None or num_tokens <= 0:
        return 0, 0.0

    def tier_of(group, digest):
        tier = state.blocks.get(group, {}).get(digest)
        if tier is None:
            tier = index.shared.get(state.model_version, {}).get(group, {}).get(digest)
        return tier

    names = list(groups)
    num_blocks = min(len(digests), (num_tokens - 1) // block_size)
    hit = longest_hit_blocks(num_blocks, [groups[g] for g in names], block_size,
                             lambda g, k: tier_of(names[g], digests[k]) is not None)
    expected = 0.0
    for k in range(hit):
        tiers = [tier_of(g, digests[k]) for g in names]
        expected += block_size * min(TIER_WEIGHTS.get(t, 0.5) if t else 1.0 for t in tiers)
    return hit * block_size, expected


def test_the_lookup_equals_the_reference_on_random_indexes_with_tiers_and_a_shared_store():
    import random

    rng = random.Random(3)
    digests = [bytes([k]) * 32 for k in range(40)]
    tiers = ("device", "host", "disk", "shared", "odd-tier")
    for trial in range(300):
        index = PrefixIndex()
        index.retain({"r0": "v1", "r1": "v1"})
        events = [{"type": "stored", "digest": d.hex(), "parent": "", "group": g, "tier": rng.choice(tiers)}
                  for d in digests for g in (FULL, SLIDING) if rng.random() < 0.85]
        index.apply("r0", {"worker_id": "w", "seq": len(events), "snapshot": True, "events": events})
        own = [{"type": "stored", "digest": d.hex(), "parent": "", "group": g, "tier": "device"}
               for d in digests for g in (FULL, SLIDING) if rng.random() < 0.5]  # r1: its own + the shared store
        index.apply("r1", {"worker_id": "w1", "seq": len(own), "snapshot": True, "events": own})
        groups = rng.choice([GROUPS, {FULL: None}, {SLIDING: 6}, {FULL: None, SLIDING: 9}])
        bs = rng.choice([1, 2, 4])
        n = rng.randrange(0, 40 * bs + 3)
        for name in ("r0", "r1", "absent"):
            assert index.hit_tokens(name, digests, n, groups, bs) == reference_hit_tokens(
                index, name, digests, n, groups, bs), (trial, name)
