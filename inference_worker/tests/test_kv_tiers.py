"""KV tiers and DualPath loading on real Gemma 3 270M weights (issue 17, acceptance 1, 2 and 5).

A writer engine with a disk tier and a shared directory runs a 560-token primer (longer than the window
W = 512, so sliding layers store only their window). The stored context is E = 563 tokens (prompt + 3 of
its 4 output tokens); with block size 16 an entry resumes at E, at 544 and at 528 (one and two blocks
before the last block boundary 560). Then:

- a restarted worker (new engine, same disk directory), a second worker (new engine, only the shared
  directory) and a host tier each resume three requests at exactly those points; greedy tokens equal a
  caching-off engine's under the top-2-gap rule (``tests/support/models.py``);
- a corrupted, a truncated and another-weights entry are each detected, counted by reason, deleted and
  recomputed with the same tokens;
- an entry idle past its TTL is gone from the disk and from the KV events (stored then removed);
- a parked request waits in ``WAITING_FOR_KV`` while another request keeps decoding.
"""

import errno
import shutil
import threading

import pytest
import torch

from inference_worker.engine.block_hash import block_digests
from inference_worker.engine.kv_events import BlockRemoved, BlockStored
from inference_worker.engine.kv_tier_record import decode_record, encode_record, tier_key
from inference_worker.engine.kv_tier_store import DirectoryKVStore, MemoryKVStore
from inference_worker.engine.kv_tiers import KVTierOptions
from inference_worker.engine.paged_engine import PagedEngineCore
from inference_worker.engine.request import RequestStatus
from inference_worker.router.prefix_index import FULL, SLIDING, PrefixIndex
from inference_worker.tests.support.models import GEMMA, load_prepared
from inference_worker.tests.support.models import assert_same_under_divergence_rule as check_divergence

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

SHA = "ab" * 32
SECRET = b"tier-secret-for-tests-0123456789"
BS = 16
MAX_TOKENS = 4
GAP = 1e-2
PRIMER_LEN = 560
E = PRIMER_LEN + MAX_TOKENS - 1  # computed tokens of the primer's context when it finishes
RESUMES = [E, 544, 528]


def tiers(*stores, **kwargs):
    return KVTierOptions(stores=list(stores), secret=SECRET, model_id=GEMMA, sweep_interval_s=0, **kwargs)


def new_engine(model, kv_tiers=None, caching=True):
    return PagedEngineCore(model, kv_cache_memory="256MiB", max_num_seqs=8, max_num_batched_tokens=4096,
                           block_size=BS, enable_prefix_caching=caching, weights_sha256=SHA, kv_tiers=kv_tiers)


def run(engine, prompts, first_id=0):
    """Greedy tokens, top-2 gaps and cached tokens of ``prompts`` run together."""
    reqs = [engine.add_request(f"r{first_id + i}", p, max_tokens=MAX_TOKENS, arrival_time=float(first_id + i))
            for i, p in enumerate(prompts)]
    tokens = {r.request_id: [] for r in reqs}
    gaps = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
            top2 = engine.last_logits(update.request_id).topk(2).values
            gaps[update.request_id].append(float(top2[0] - top2[1]))
    return [(tokens[r.request_id], gaps[r.request_id]) for r in reqs], [r.num_cached_tokens for r in reqs]


@pytest.fixture(scope="module")
def gemma():
    return load_prepared(GEMMA).model


@pytest.fixture(scope="module")
def written(gemma, tmp_path_factory):
    """The primer run on a writer with a disk and a shared tier; its context, the resumed prompts and their
    caching-off reference."""
    root = tmp_path_factory.mktemp("tiers")
    disk, shared = DirectoryKVStore(root / "disk", 1 << 30), DirectoryKVStore(root / "shared", 1 << 30, "shared")
    gen = torch.Generator().manual_seed(17)
    primer = [2] + torch.randint(300, 200_000, (PRIMER_LEN - 1,), generator=gen).tolist()
    writer = new_engine(gemma, tiers(disk, shared))
    (out, _), = run(writer, [primer])[0]
    writer.connector.flush()
    context = primer + out[: MAX_TOKENS - 1]
    prompts = []
    for r in RESUMES:  # continue the context differently from position r on
        tail = torch.randint(300, 200_000, (5,), generator=gen).tolist()
        if r < E:
            tail[0] = context[r] + 1
        prompts.append(context[:r] + tail)
    reference, hits = run(new_engine(gemma, caching=False), prompts)
    assert hits == [0, 0, 0]
    stats = writer.connector.tier_stats()
    assert stats["disk"]["entries"] == stats["shared"]["entries"] == 1
    writer.connector.close()
    return {"root": root, "prompts": prompts, "reference": reference, "context": context}


def check(label, got, reference):
    check_divergence(label, [t for t, _ in got], reference, num_tokens=MAX_TOKENS, gap=GAP)


def pristine(written, tier, tmp_path):
    """A copy of the writer's ``tier`` directory (tests write entries of their own; each starts from the writer's)."""
    shutil.copytree(written["root"] / tier, tmp_path / tier)
    return tmp_path / tier


@pytest.mark.parametrize("tier", ["disk", "shared"])
def test_resume_from_a_restarted_disk_tier_and_a_second_worker_shared_tier_equals_recompute(gemma, written, tier,
                                                                                             tmp_path):
    store = DirectoryKVStore(pristine(written, tier, tmp_path), 1 << 30, tier)
    engine = new_engine(gemma, tiers(store))
    if tier == "disk":  # the restarted worker publishes its disk tier in the snapshot
        snapshot = engine.connector.snapshot_events()
        assert {e.tier for e in snapshot} == {"disk"}
        assert sum(e.group == "full_attention" for e in snapshot) == 560 // BS
        assert sum(e.group == "sliding_attention" for e in snapshot) == 560 // BS - 1  # blocks 1..34: positions from floor((528 - 511) / 16) * 16
    else:  # the shared store is announced by its writer, not by a worker that only reads it
        assert engine.connector.snapshot_events() == []
    got, hits = run(engine, written["prompts"], first_id=10)
    assert hits == RESUMES
    check(f"{tier}-tier", got, written["reference"])
    stats = engine.connector.tier_stats()[tier]
    assert stats["hit_tokens"] == sum(RESUMES)
    assert stats["integrity_failures"] == {}
    assert stats["read_bytes"] > 0 and stats["load_seconds"] > 0
    engine.connector.close()


def test_resume_from_the_host_tier_equals_recompute(gemma, written):
    engine = new_engine(gemma, tiers(MemoryKVStore(1 << 30)))
    run(engine, [written["context"][:PRIMER_LEN]], first_id=20)  # same primer: same context E
    engine.connector.flush()
    engine.kv_cache_manager.reset_prefix_cache()  # only the device copy is forgotten
    got, hits = run(engine, written["prompts"], first_id=30)
    assert hits == RESUMES
    check("host-tier", got, written["reference"])
    engine.connector.close()


def test_corrupted_truncated_and_other_weights_entries_are_counted_and_recomputed(gemma, written, tmp_path):
    [good] = list((written["root"] / "disk").glob("*.kvt"))
    data = good.read_bytes()
    key = tier_key(SECRET)
    header, body = decode_record(data, key)
    layers, offset, row = [], 0, header.num_kv_heads * header.head_dim * 4
    for rows in header.layer_rows():
        layers.append((bytes(body[offset: offset + rows * row]), bytes(body[offset + rows * row: offset + 2 * rows * row])))
        offset += 2 * rows * row
    other_weights = encode_record(type(header)(**{**vars(header), "weights_sha256": "cd" * 32}), layers, key)
    corrupted = bytearray(data)
    corrupted[len(data) // 2] ^= 0x01
    cases = {"signature": bytes(corrupted), "truncated": data[: len(data) - 1000], "weights": other_weights}
    store = DirectoryKVStore(tmp_path / "disk", 1 << 30)
    engine = new_engine(gemma, tiers(store))
    for i, (reason, payload) in enumerate(cases.items()):
        shutil.rmtree(store.root)
        store.root.mkdir()
        (store.root / good.name).write_bytes(payload)
        engine.kv_cache_manager.reset_prefix_cache()
        got, hits = run(engine, written["prompts"][:1], first_id=40 + i)
        assert hits == [0], reason  # recomputed
        check(f"bad-entry-{reason}", got, written["reference"][:1])
        assert engine.connector.stats["disk"].integrity_failures[reason] == 1
        assert not (store.root / good.name).exists()  # the bad entry is deleted
        engine.connector.flush()
    assert dict(engine.connector.stats["disk"].integrity_failures) == {"signature": 1, "truncated": 1, "weights": 1}
    engine.connector.close()


class FailingStore(DirectoryKVStore):
    """A disk tier whose filesystem fails every operation with EIO once ``failing`` is set (a lost mount)."""

    failing = False

    def _check(self):
        if self.failing:
            raise OSError(errno.EIO, "Input/output error", str(self.root))

    def entries(self):
        self._check()
        return super().entries()

    def contains(self, key):
        self._check()
        return super().contains(key)

    def _read(self, key):
        self._check()
        return super()._read(key)

    def _write(self, key, data):
        self._check()
        super()._write(key, data)


@pytest.mark.parametrize("failure", ["removed", "io_error"])
def test_a_tier_directory_removed_or_failing_is_a_miss_and_never_stops_the_engine(gemma, written, tmp_path, failure):
    # A worker whose disk tier directory was removed stopped its engine loop for good (tier_stats' listing raised
    # FileNotFoundError in the step loop's stats publication); any OSError of a store is now a counted miss.
    store = FailingStore(pristine(written, "disk", tmp_path), 1 << 30)
    engine = new_engine(gemma, tiers(store))
    if failure == "removed":
        shutil.rmtree(store.root)
    else:
        store.failing = True
    got, hits = run(engine, written["prompts"][:1], first_id=60)
    assert hits == [0]  # the indexed entry could not be used: computed
    check(f"failing-tier-{failure}", got, written["reference"][:1])
    engine.connector.flush()
    stats = engine.connector.tier_stats()["disk"]
    if failure == "removed":  # the directory comes back with the next write
        assert (stats["entries"], stats["io_errors"], len(list(store.root.glob("*.kvt")))) == (1, 0, 1)
    else:  # lookup, the write after the request and the listing above each failed and were counted
        assert (stats["entries"], stats["written_bytes"], stats["io_errors"]) == (0, 0, 3)
    engine.connector.sweep()
    engine.connector.reset()
    assert engine.prefix_cache_stats()["tiers"]["disk"]["io_errors"] == (0 if failure == "removed" else 6)
    engine.connector.close()


def test_an_entry_idle_past_its_ttl_is_gone_from_disk_and_from_the_events(gemma, tmp_path):
    store = DirectoryKVStore(tmp_path / "disk", 1 << 30)
    engine = new_engine(gemma, tiers(store, entry_ttl_s=60))
    prompt = [2] + list(range(1000, 1040))
    run(engine, [prompt])
    engine.connector.flush()
    stored = [e for e in engine.kv_cache_manager.take_events() if getattr(e, "tier", None) == "disk"]
    assert all(isinstance(e, BlockStored) for e in stored) and len(stored) == 2 * (43 // BS)
    # The router's prefix index (part 1's event format) reads the disk tier's events: a 32-token hit at
    # the disk tier's weight for the same prompt; none once the entry has expired.
    index = PrefixIndex()
    index.retain({"r0": "v1"})
    digests = block_digests(engine.kv_cache_manager.prefix_root, prompt + [7] * 8, BS)

    def router_hit(events, seq, snapshot):
        assert index.apply("r0", {"worker_id": "w", "seq": seq, "snapshot": snapshot,
                                  "events": [e.as_dict() for e in events]})
        return index.hit_tokens("r0", digests, len(prompt) + 8, {FULL: None, SLIDING: 512}, BS)

    assert router_hit([*engine.connector.snapshot_events()], len(stored), True) == (32, 32 * 0.6)
    [entry] = store.entries()
    assert engine.connector.sweep(now=entry.last_access_s + 59) == 0  # not idle long enough
    assert engine.connector.sweep(now=entry.last_access_s + 61) == 1
    assert store.entries() == [] and list(store.root.glob("*.kvt")) == []
    removed = [e for e in engine.kv_cache_manager.take_events() if getattr(e, "tier", None) == "disk"]
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert {(e.digest, e.group) for e in removed} == {(e.digest, e.group) for e in stored}
    assert router_hit(removed, len(stored) + len(removed), False) == (0, 0.0)
    assert engine.connector.snapshot_events() == []
    assert engine.connector.tier_stats()["disk"]["expiries"] == 1
    engine.connector.close()


class GatedStore(DirectoryKVStore):
    """A directory store whose reads wait for a gate (a slow cold path)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def get(self, key):
        self.gate.wait(30)
        return super().get(key)


def test_a_loading_request_waits_in_its_own_state_while_others_keep_decoding(gemma, written, tmp_path):
    store = GatedStore(pristine(written, "disk", tmp_path), 1 << 30)
    engine = new_engine(gemma, tiers(store))
    engine.add_request("decoding", [2] + list(range(500, 520)), max_tokens=8, arrival_time=0.0)
    loading = engine.add_request("loading", written["prompts"][0], max_tokens=MAX_TOKENS, arrival_time=1.0)
    decoded = []
    for _ in range(6):
        decoded += [u.new_token_ids for u in engine.step() if u.request_id == "decoding"]
        assert loading.status == RequestStatus.WAITING_FOR_KV
    assert len(decoded) == 6  # one token per step while the other request's KV loads
    store.gate.set()
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for u in engine.step() if u.request_id == "loading" for t in u.new_token_ids]
    check("dualpath", [(tokens, [])], written["reference"][:1])
    assert engine.connector.stats["disk"].hit_tokens == E
    engine.connector.close()
