"""KV cache managers: sliding-window freeing with exact block tables, full attention keeps every block."""

import pytest

from inference_worker.engine.kv_cache_manager import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    HybridKVCacheManager,
    KVCacheGroupSpec,
)

W = 4  # sliding window (tokens)
BS = 2  # block size (tokens)


def make_manager(num_blocks_full=40, num_blocks_sliding=40):
    return HybridKVCacheManager(
        [
            KVCacheGroupSpec(FULL_ATTENTION, (2,), None, num_blocks_full, BS),
            KVCacheGroupSpec(SLIDING_ATTENTION, (0, 1), W, num_blocks_sliding, BS),
        ]
    )


# Prefill N tokens in one chunk, then schedule the decode of position N.
# Expected sliding table after the decode allocation: blocks wholly at positions <= N - W are null.
@pytest.mark.parametrize(
    ("num_prompt", "sliding_table", "num_free_sliding"),
    [
        (W - 1, [1, 2], 37),  # positions 0..3; query 3 sees 0..3: nothing freed
        (W, [1, 2, 3], 36),  # query 4 sees 1..4: block 0 (0,1) still holds position 1
        (W + 1, [0, 2, 3], 37),  # query 5 sees 2..5: block 0 freed
        (5 * W, [0] * 8 + [9, 10, 11], 36),  # query 20 sees 17..20: blocks 0..7 freed, block 11 new
    ],
)
def test_sliding_window_frees_blocks_wholly_before_the_window(num_prompt, sliding_table, num_free_sliding):
    kv = make_manager()
    prefill = kv.allocate_slots("r", 0, num_prompt)
    num_prefill_blocks = -(-num_prompt // BS)
    assert prefill == (list(range(1, num_prefill_blocks + 1)), list(range(1, num_prefill_blocks + 1)))
    kv.allocate_slots("r", num_prompt, 1)
    full_table, table = kv.get_block_ids("r")
    assert table == sliding_table
    assert full_table == list(range(1, -(-(num_prompt + 1) // BS) + 1))
    assert kv.get_num_free_blocks() == (39 - len(full_table), num_free_sliding)
    assert kv.num_held_blocks("r") == (len(full_table), 39 - num_free_sliding)
    kv.free("r")
    assert kv.get_num_free_blocks() == (39, 39)


@pytest.mark.parametrize("num_prompt", [1, W - 1, W, W + 1, 3 * W + 1])
def test_decode_keeps_exactly_the_window_readable_and_full_attention_keeps_all(num_prompt):
    kv = make_manager()
    kv.allocate_slots("r", 0, num_prompt)
    for position in range(num_prompt, 5 * W + 3):
        kv.allocate_slots("r", position, 1)
        full_table, table = kv.get_block_ids("r")
        # full attention: one live block per BS positions, never the null block
        assert 0 not in full_table and len(full_table) == position // BS + 1
        assert len(set(full_table)) == len(full_table)
        # sliding: positions position-W+1..position are readable, the earlier whole blocks are null
        first_needed_block = max(0, position - W + 1) // BS
        assert table[:first_needed_block] == [0] * first_needed_block
        assert 0 not in table[first_needed_block:]
        assert kv.num_held_blocks("r")[1] == len(table) - first_needed_block
    kv.free("r")
    assert kv.get_num_free_blocks() == kv.get_num_usable_blocks() == (39, 39)


def test_chunked_prefill_frees_blocks_behind_each_chunk():
    kv = make_manager()
    assert kv.allocate_slots("r", 0, 6) == ([1, 2, 3], [1, 2, 3])
    # next chunk starts at position 6: query 6 sees 3..6, so block 0 (0,1) goes, block 1 (2,3) stays
    assert kv.allocate_slots("r", 6, 4) == ([4, 5], [4, 5])
    assert kv.get_block_ids("r") == ([1, 2, 3, 4, 5], [0, 2, 3, 4, 5])


def test_allocation_is_all_or_nothing_across_groups():
    kv = make_manager(num_blocks_full=4, num_blocks_sliding=40)  # 3 usable full blocks
    assert kv.allocate_slots("a", 0, 4) == ([1, 2], [1, 2])
    assert kv.allocate_slots("b", 0, 3) is None  # full group needs 2, has 1
    assert kv.get_block_ids("b") == ([], [])
    assert kv.get_num_free_blocks() == (1, 37)
    kv.free("a")
    assert kv.allocate_slots("b", 0, 3) == ([3, 2], [3, 4])  # full: only the freed blocks remain
    kv.free("b")
    assert kv.get_num_free_blocks() == (3, 39)


def test_two_requests_share_the_pool_and_free_everything():
    kv = make_manager(num_blocks_full=20, num_blocks_sliding=8)
    for position in range(0, 12):
        for request_id in ("a", "b"):
            assert kv.allocate_slots(request_id, position, 1) is not None
    # sliding: each holds at most cdiv(W, BS) + 1 blocks; full: 6 blocks each
    assert kv.num_held_blocks("a") == (6, 2) and kv.num_held_blocks("b") == (6, 2)
    assert kv.get_usage() == 12 / 19
    kv.free("a")
    kv.free("b")
    kv.free("never-seen")
    assert kv.get_num_free_blocks() == (19, 7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attention_type": "global"}, "unknown attention_type"),
        ({"sliding_window": 4}, "sliding_window must be set for sliding_attention"),
        ({"block_size": 0}, "block_size must be >= 1"),
    ],
)
def test_group_spec_validation(kwargs, message):
    spec = {"attention_type": FULL_ATTENTION, "layer_indices": (0,), "sliding_window": None, "num_blocks": 4, "block_size": 2}
    spec.update(kwargs)
    with pytest.raises(ValueError, match=message):
        KVCacheGroupSpec(**spec)


def test_groups_must_share_block_size():
    with pytest.raises(ValueError, match="share one block_size"):
        HybridKVCacheManager(
            [
                KVCacheGroupSpec(FULL_ATTENTION, (0,), None, 4, 2),
                KVCacheGroupSpec(SLIDING_ATTENTION, (1,), 4, 4, 4),
            ]
        )


def test_readable_blocks_for_a_tier_save_are_registered_blocks_only():
    """Saving a context to a KV tier reads only blocks registered under the request's digests (a nulled
    sliding block still cached counts; a PD import's partly written first sliding block never does) and
    the partial last block."""
    kv = HybridKVCacheManager(
        [KVCacheGroupSpec(FULL_ATTENTION, (2,), None, 40, BS), KVCacheGroupSpec(SLIDING_ATTENTION, (0, 1), W, 40, BS)],
        enable_prefix_caching=True, prefix_root=b"\x01" * 32)
    tokens = list(range(100, 111))  # 11 tokens: 5 full blocks and a partial one
    # A PD import of 10 tokens: sliding KV from position 10 - (W-1) = 7, so sliding block 3 (6, 7) is partly written.
    kv.allocate_slots("pd", 10, 1)
    kv.set_first_registrable_blocks("pd", [0, 7])
    kv.cache_blocks("pd", 11, tokens[:10], tokens[10:])
    digests = kv.request_block_digests("pd", tokens[:10], tokens[10:], 11)
    full, sliding = kv.get_block_ids("pd")
    assert kv.readable_block_ids("pd", digests) == (full, [0, 0, 0, 0, sliding[4], sliding[5]])
    # A request that computed the same tokens itself: its sliding blocks 0..3 are registered (pd's are not),
    # blocks 4 and the full ones were registered by pd first; nulled blocks stay readable while cached.
    kv.allocate_slots("own", 0, 11)
    kv.cache_blocks("own", 11, tokens[:10], tokens[10:])
    own_full, before = kv.get_block_ids("own")
    kv.allocate_slots("own", 11, 1)  # nulls sliding blocks 0..3 (positions <= 7, before the window of 11)
    assert kv.get_block_ids("own")[1][:4] == [0, 0, 0, 0]
    assert kv.readable_block_ids("own", digests) == (full[:5] + [own_full[5]], before[:4] + [sliding[4], before[5]])
