"""Prefix caching on the torch-free core: block digests, the hybrid hit rule (resume points W-2, W-1, W,
W+1, block sizes 1, 2, 7, 16), registration of whole blocks only, LRU eviction and KV events.
The scheduler with hits is tested in ``test_prefix_cache_scheduler``.
"""

import pytest

from inference_worker.engine.block_hash import (
    block_digest,
    block_digests,
    first_needed_block,
    longest_hit_blocks,
    prefix_root,
)
from inference_worker.engine.kv_cache_manager import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    HybridKVCacheManager,
    KVCacheGroupSpec,
)
from inference_worker.engine.kv_events import AllCleared, BlockRemoved, BlockStored

SHA = "ab" * 32
ROOT2 = prefix_root(SHA, "float32", 2)


# ---- digests ---------------------------------------------------------------------------------

def test_digest_is_pinned_chained_and_salted():
    # pinned: the router and other workers compute the same digests (a format change must be deliberate)
    assert ROOT2.hex() == "62626caa0bf480b99c6422960d75856a204fc9c171ae662d2bc1dd029d2284cf"
    assert prefix_root(SHA.upper(), "float32", 2) == ROOT2
    assert block_digest(ROOT2, [1, 2]).hex() == "c36ac7069af11c2117da25deb1b55f214e2155b24ee1cd598a7b890f9bb5e42c"
    assert block_digests(ROOT2, [1, 2, 3], 2) == [block_digest(ROOT2, [1, 2])]
    salts = {prefix_root(SHA, "float32", 2), prefix_root(SHA, "bfloat16", 2), prefix_root(SHA, "float32", 4),
             prefix_root("cd" * 32, "float32", 2)}
    assert len(salts) == 4
    d = block_digests(ROOT2, [5, 6, 7, 8, 9], 2)
    assert len(d) == 2  # the partial block has no digest
    assert d[1] == block_digest(d[0], [7, 8])
    assert block_digests(ROOT2, [5, 6, 0, 8], 2)[1] != d[1]  # one token differs
    assert block_digests(ROOT2, [9, 6, 7, 8], 2)[1] != d[1]  # an earlier block differs: the chain differs
    assert block_digests(ROOT2, [5, 6, 7, 8, 9, 10], 2, start=d[:1]) == block_digests(ROOT2, [5, 6, 7, 8, 9, 10], 2)
    with pytest.raises(ValueError):
        block_digest(b"short", [1])
    with pytest.raises(ValueError):
        block_digest(ROOT2, [-1])
    with pytest.raises(ValueError):
        prefix_root(SHA, "float32", 0)


# ---- the hybrid hit rule ----------------------------------------------------------------------

W = 16


def brute_force_hit(num_blocks, windows, bs, cached):
    """The definition: the largest h whose every group has every block the query at h*bs reads."""
    for h in range(num_blocks, -1, -1):
        if all(cached(g, k) for g, w in enumerate(windows) for k in range(first_needed_block(h * bs, w, bs), h)):
            return h
    return 0


@pytest.mark.parametrize("bs", [1, 2, 7, 16])
@pytest.mark.parametrize("resume", [W - 2, W - 1, W, W + 1, 3 * W + 5])
def test_hit_rule_on_a_kept_context_matches_its_definition(bs, resume):
    """A context of ``resume`` tokens kept hybrid-sized: full blocks all, sliding only the window of ``resume``."""
    num_cached = resume // bs
    first = first_needed_block(resume, W, bs)

    def cached(g, k):
        return k < num_cached and (g == 0 or k >= first)

    for num_prompt in (resume, resume + 1, resume + 3 * bs):  # the prompt extends the context or equals it
        max_blocks = min(num_cached, (num_prompt - 1) // bs)
        got = longest_hit_blocks(max_blocks, [None, W], bs, cached)
        assert got == brute_force_hit(max_blocks, [None, W], bs, cached)
        if num_prompt > resume and resume % bs == 0:
            assert got * bs == resume  # the whole aligned context is reused


@pytest.mark.parametrize(
    ("bs", "resume", "num_prompt", "expected_hit_tokens"),
    [
        (1, W - 2, 40, W - 2),  # nothing left the window: all reused
        (1, W - 1, 40, W - 1),
        (1, W, 40, W),  # position 0 left the window of W: the query at W does not read it
        (1, W + 1, 40, W + 1),
        (1, W + 1, W + 1, 0),  # last token computed: hit W would read position 0, which is gone; so would 1..W
        (2, W + 1, 40, 0),  # hit 16 (aligned) reads positions 1..15; block 0 (0, 1) is gone
        (2, W + 2, 40, W + 2),  # hit 18 reads 3..17: blocks 1..8, all kept
        (7, W + 5, 40, 21),  # hit 21 reads 6..20: blocks 0..2, kept
        (16, W, 40, W),
    ],
)
def test_hit_rule_exact_values_at_the_window_edges(bs, resume, num_prompt, expected_hit_tokens):
    num_cached, first = resume // bs, first_needed_block(resume, W, bs)
    hit = longest_hit_blocks(min(num_cached, (num_prompt - 1) // bs), [None, W], bs,
                             lambda g, k: k < num_cached and (g == 0 or k >= first))
    assert hit * bs == expected_hit_tokens


def test_hit_rule_falls_back_past_a_hole_in_the_sliding_group():
    # full: 10 blocks; bs=2, W=4: a hit of h blocks reads sliding blocks (2h-3)//2 .. h-1
    assert longest_hit_blocks(10, [None, 4], 2, lambda g, k: g == 0 or k != 6) == 10  # 6 is outside 20's window
    assert longest_hit_blocks(10, [None, 4], 2, lambda g, k: g == 0 or k != 8) == 8  # 8 reads blocks 6, 7
    assert longest_hit_blocks(10, [None, 4], 2, lambda g, k: g == 0 or k not in (7, 8)) == 7  # 7 reads 5, 6
    assert longest_hit_blocks(10, [None], 2, lambda g, k: k != 3) == 3  # dense: the first hole ends the hit


# ---- manager: registration, hits, LRU eviction, events ----------------------------------------

BS = 2


def make_manager(num_full=20, num_sliding=20, window=4, bs=BS, caching=True):
    return HybridKVCacheManager(
        [KVCacheGroupSpec(FULL_ATTENTION, (0,), None, num_full + 1, bs),
         KVCacheGroupSpec(SLIDING_ATTENTION, (1,), window, num_sliding + 1, bs)],
        enable_prefix_caching=caching, prefix_root=prefix_root(SHA, "float32", bs))


def compute(kv, rid, tokens):
    """Allocate and 'compute' all of ``tokens`` in one chunk, register, as the scheduler does."""
    hit, blocks = kv.get_computed_blocks(rid, tokens)
    assert kv.allocate_slots(rid, hit, len(tokens) - hit, blocks) is not None
    kv.cache_blocks(rid, len(tokens), tokens)
    return hit


def test_only_full_blocks_are_registered_and_a_second_request_shares_them():
    kv = make_manager()
    tokens = [11, 12, 13, 14, 15]
    assert compute(kv, "a", tokens) == 0
    assert kv.get_num_cached_blocks() == (2, 2)  # block 2 holds only position 4: never registered
    a_tables = kv.get_block_ids("a")
    hit, _ = kv.get_computed_blocks("b", tokens + [16, 17])
    assert hit == 4
    assert compute(kv, "b", tokens + [16, 17]) == 4
    full_b, sliding_b = kv.get_block_ids("b")
    assert full_b[:2] == a_tables[0][:2]  # shared blocks, not copies
    assert sliding_b[:2] == a_tables[1][:2]  # the query at 4 reads positions 1..3 (W = 4): blocks 0 and 1
    assert kv.block_pools[0].blocks[full_b[0]].ref_cnt == 2


def test_last_prompt_token_is_always_computed():
    kv = make_manager()
    compute(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    assert kv.get_computed_blocks("b", [1, 2, 3, 4])[0] == 2  # not 4: the last token's logits are needed
    assert kv.get_computed_blocks("c", [1, 2, 3, 4, 5])[0] == 4


def test_freed_blocks_stay_reusable_until_their_memory_is_needed_least_recently_freed_first():
    kv = make_manager(num_full=6, num_sliding=6)
    compute(kv, "a", [1, 2, 3, 4])  # 2 blocks per group
    compute(kv, "b", [9, 8, 7, 6])
    kv.free("a")
    kv.free("b")
    kv.take_events()
    digests_a = block_digests(kv.prefix_root, [1, 2, 3, 4], BS)
    assert kv.get_num_free_blocks() == (6, 6)  # cached blocks count as free
    assert kv.get_computed_blocks("x", [1, 2, 3, 4, 5])[0] == 4
    compute(kv, "c", [50, 51, 52, 53])  # takes the 2 never-used blocks per group: nothing evicted
    assert kv.get_num_evictions() == (0, 0)
    compute(kv, "d", [60, 61, 62, 63])  # needs 2 more: a's blocks (freed first), its tail block first
    assert kv.get_num_evictions() == (2, 2)
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert [(e.digest, e.group) for e in removed] == [
        (digests_a[1], FULL_ATTENTION), (digests_a[0], FULL_ATTENTION),
        (digests_a[1], SLIDING_ATTENTION), (digests_a[0], SLIDING_ATTENTION)]
    assert kv.get_computed_blocks("y", [1, 2, 3, 4, 5])[0] == 0
    assert kv.get_computed_blocks("z", [9, 8, 7, 6, 5])[0] == 4  # b's blocks were not needed


def test_events_stored_with_parent_chain_and_cleared_on_reset():
    kv = make_manager()
    compute(kv, "a", [1, 2, 3, 4])
    d = block_digests(kv.prefix_root, [1, 2, 3, 4], BS)
    events = kv.take_events()
    assert events == [BlockStored(d[0], kv.prefix_root, FULL_ATTENTION), BlockStored(d[1], d[0], FULL_ATTENTION),
                      BlockStored(d[0], kv.prefix_root, SLIDING_ATTENTION), BlockStored(d[1], d[0], SLIDING_ATTENTION)]
    assert events[1].as_dict() == {"type": "stored", "digest": d[1].hex(), "parent": d[0].hex(),
                                   "group": "full_attention", "tier": "device"}
    assert kv.snapshot_events() == [AllCleared(), *events]
    assert kv.reset_prefix_cache() == 4
    assert kv.take_events() == [AllCleared()]
    assert kv.get_num_cached_blocks() == (0, 0)
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5])[0] == 0


def test_received_kv_never_registers_a_partly_written_block():
    tokens = [1, 2, 3, 4, 5, 6, 7]
    # a PD import of 7 tokens, W = 4: sliding layers received positions 4..6 (the last W-1); block 2 (4, 5) is whole
    kv = make_manager()
    kv.allocate_slots("imp", 7, 0)
    kv.set_first_registrable_blocks("imp", [0, 4])
    kv.cache_blocks("imp", 7, tokens)
    assert kv.get_num_cached_blocks() == (3, 1)  # full: blocks 0..2; sliding: block 2; block 3 (6) is partial
    assert kv.get_block_ids("imp")[1] == [0, 0, 1, 2]
    assert kv.get_computed_blocks("b", tokens + [8, 9])[0] == 0  # hit 6 reads sliding 3..5: position 3 is gone
    # with W = 5 the window of 7 is 3..6: block 1 (2, 3) is allocated but position 2 was never written
    kv = make_manager(window=5)
    kv.allocate_slots("imp", 7, 0)
    kv.set_first_registrable_blocks("imp", [0, 3])
    kv.cache_blocks("imp", 7, tokens)
    assert kv.get_block_ids("imp")[1] == [0, 1, 2, 3]
    sliding = kv.block_pools[1]
    assert sliding.blocks[1].block_hash is None and sliding.blocks[2].block_hash is not None
    assert kv.get_num_cached_blocks() == (3, 1)
    assert kv.get_computed_blocks("b", tokens + [8, 9])[0] == 0  # hit 6 would read positions 2..5


def test_prefix_caching_off_registers_and_hits_nothing():
    kv = make_manager(caching=False)
    compute(kv, "a", [1, 2, 3, 4, 5])
    assert kv.get_num_cached_blocks() == (0, 0)
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5])[0] == 0
    with pytest.raises(ValueError):
        HybridKVCacheManager([KVCacheGroupSpec(FULL_ATTENTION, (0,), None, 4, 2)], enable_prefix_caching=True)


def test_block_digests_equal_the_per_block_chain_for_every_start_and_length():
    # block_digests packs every full block in one call; each digest must stay block_digest of its parent and block
    import random

    rng = random.Random(7)
    for bs in (1, 2, 7, 16):
        for n in (0, 1, bs - 1, bs, bs + 1, 5 * bs, 5 * bs + 3):
            tokens = [rng.randrange(2**32) for _ in range(n)]
            chain, parent = [], ROOT2
            for k in range(n // bs):
                parent = block_digest(parent, tokens[k * bs : (k + 1) * bs])
                chain.append(parent)
            assert block_digests(ROOT2, tokens, bs) == chain
            for known in range(len(chain) + 1):
                assert block_digests(ROOT2, tokens, bs, start=chain[:known]) == chain
    with pytest.raises(ValueError):
        block_digests(ROOT2, [1, 2**32], 2)
    with pytest.raises(ValueError):
        block_digests(b"short", [1, 2], 2)
    assert block_digests(ROOT2, [1, 2, -1], 2) == [block_digest(ROOT2, [1, 2])]  # a partial block is not packed
