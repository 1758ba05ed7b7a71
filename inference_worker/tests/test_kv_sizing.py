"""KV cache sizing (--kv-cache-memory -> blocks per group) and measured KV bytes per sequence vs DESIGN."""

from types import SimpleNamespace

import pytest

from inference_worker.config import ModelConfig
from inference_worker.engine import kv_cache_sizing
from inference_worker.engine.kv_cache_manager import FULL_ATTENTION, HybridKVCacheManager, KVCacheGroupSpec
from inference_worker.engine.kv_cache_sizing import (
    parse_kv_cache_memory,
    plan_kv_cache,
    resolve_kv_cache_bytes,
)
from inference_worker.registry import resolve_model


@pytest.fixture(scope="module")
def gemma_config():
    return ModelConfig.from_gguf(resolve_model("gemma-3-270m").path)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (1_000_000, ("bytes", 1_000_000)),
        ("2GiB", ("bytes", 2 * 2**30)),
        ("512MB", ("bytes", 512_000_000)),
        ("1.5 KiB", ("bytes", 1536)),
        ("4096", ("bytes", 4096)),
        (0.5, ("fraction", 0.5)),
        ("0.9", ("fraction", 0.9)),
        (1.0, ("fraction", 1.0)),
    ],
)
def test_parse_kv_cache_memory(value, parsed):
    assert parse_kv_cache_memory(value) == parsed


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lots", "cannot parse"),
        ("3 parsecs", "unknown unit"),
        (0, "must be positive"),
        ("0GiB", "must be positive"),
        (1.5, r"fraction must be in \(0, 1\]"),
        (0.0, r"fraction must be in \(0, 1\]"),
        (True, "bytes or a fraction"),
    ],
)
def test_parse_kv_cache_memory_rejects(value, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_cache_memory(value)


def test_fraction_applies_to_accelerator_memory_or_available_ram(monkeypatch):
    assert resolve_kv_cache_bytes(0.25, free_accelerator_bytes=8_000) == 2_000
    assert resolve_kv_cache_bytes("1KiB", free_accelerator_bytes=8_000) == 1024
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=10_000))
    assert resolve_kv_cache_bytes(0.5) == 5_000


def test_gemma_plan_caps_sliding_group_at_its_bound_and_gives_full_the_rest(gemma_config):
    plan = plan_kv_cache(
        gemma_config, budget_bytes=2**30, block_size=16, dtype_bytes=2, max_num_seqs=32, max_num_batched_tokens=2048
    )
    # block bytes: full 1024 B/token/layer * 16 * 3 layers = 49152; sliding * 15 layers = 245760
    # sliding bound: 32 * (cdiv(511, 16) + 2) + cdiv(2048, 16) = 1216 blocks
    # full: (2**30 - 49152 - 245760 - 1216 * 245760) // 49152 = 15759 blocks
    assert plan.as_dict() == {
        "budget_bytes": 2**30,
        "block_size": 16,
        "dtype_bytes": 2,
        "groups": {
            "full_attention": {"num_layers": 3, "sliding_window": None, "num_blocks": 15760, "num_tokens": 252144,
                               "bytes": 15760 * 49152},
            "sliding_attention": {"num_layers": 15, "sliding_window": 512, "num_blocks": 1217, "num_tokens": 19456,
                                  "bytes": 1217 * 245760},
        },
    }
    assert sum(g.total_bytes for g in plan.groups) <= 2**30
    assert [s.layer_indices for s in plan.group_specs()] == [(5, 11, 17), (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16)]
    assert plan.log_line().startswith("KV cache 1.00 GiB, block_size 16: full_attention 3 layers 15759 blocks 252144 tokens")


def test_prefix_caching_sizes_both_groups_equally_so_cached_contexts_keep_their_windows(gemma_config):
    plan = plan_kv_cache(gemma_config, budget_bytes=2**30, block_size=16, dtype_bytes=2, max_num_seqs=32,
                         max_num_batched_tokens=2048, enable_prefix_caching=True)
    # (2**30 - 294912) // 294912 = 3639 sliding blocks (the running bound of 1216 is not a cap any more); full gets
    # the rest: (2**30 - 294912 - 3639 * 245760) // 49152 = 3644
    assert [g.num_blocks for g in plan.groups] == [3645, 3640]


def test_small_budget_splits_blocks_equally_between_groups(gemma_config):
    plan = plan_kv_cache(
        gemma_config, budget_bytes=30 * 294912, block_size=16, dtype_bytes=2, max_num_seqs=32, max_num_batched_tokens=2048
    )
    assert [g.num_blocks for g in plan.groups] == [30, 30]


def test_dense_model_has_one_group():
    dense = SimpleNamespace(layer_types=("full_attention",) * 4, sliding_window=None,
                            kv_bytes_per_token=lambda t, d: 2 * 3 * 64 * d)
    plan = plan_kv_cache(dense, budget_bytes=10 * 2**20, block_size=16, dtype_bytes=4, max_num_seqs=8,
                         max_num_batched_tokens=512)
    # block = 1536 B/token * 16 * 4 layers = 98304 B; (10 MiB - 98304) // 98304 = 105
    assert [(g.attention_type, g.num_blocks, g.num_tokens) for g in plan.groups] == [("full_attention", 106, 1680)]


def test_budget_too_small_is_a_clear_error(gemma_config):
    with pytest.raises(ValueError, match="leaves no usable full_attention block"):
        plan_kv_cache(gemma_config, budget_bytes=300_000, block_size=16, dtype_bytes=2, max_num_seqs=1,
                      max_num_batched_tokens=16)


def measured_kv_bytes(plan_groups, num_tokens, chunk=2048):
    """Prefill num_tokens - 1 tokens in chunks, schedule the last token, return bytes held per the allocator."""
    kv = HybridKVCacheManager([spec for spec, _ in plan_groups])
    computed = 0
    while computed < num_tokens - 1:
        n = min(chunk, num_tokens - 1 - computed)
        assert kv.allocate_slots("r", computed, n) is not None
        computed += n
    assert kv.allocate_slots("r", computed, 1) is not None  # computing token N (position N - 1)
    return sum(held * block_bytes for held, (_, block_bytes) in zip(kv.num_held_blocks("r"), plan_groups))


@pytest.mark.parametrize("num_tokens", [1024, 4096, 8192])
def test_kv_bytes_per_sequence_match_design_formula(gemma_config, num_tokens):
    plan = plan_kv_cache(gemma_config, budget_bytes=2**30, block_size=16, dtype_bytes=2, max_num_seqs=4,
                         max_num_batched_tokens=2048)
    hybrid = measured_kv_bytes([(s, g.bytes_per_block) for s, g in zip(plan.group_specs(), plan.groups)], num_tokens)
    num_all_full_blocks = 18 * num_tokens // 16 + 2
    all_full_group = KVCacheGroupSpec(FULL_ATTENTION, tuple(range(18)), None, num_all_full_blocks, 16)
    all_full = measured_kv_bytes([(all_full_group, 1024 * 16 * 18)], num_tokens)
    formula = gemma_config.kv_bytes(num_tokens, dtype_bytes=2)
    assert abs(hybrid / formula - 1) <= 0.10
    assert all_full == gemma_config.kv_bytes(num_tokens, hybrid=False, dtype_bytes=2)
    if num_tokens == 8192:
        assert hybrid == formula == 33_030_144  # 1024 * (3 * 8192 + 15 * 512): block-aligned, no rounding
        assert round(all_full / hybrid, 2) == 4.57


def test_sizing_module_logs_the_plan(gemma_config, caplog):
    with caplog.at_level("INFO", logger=kv_cache_sizing.__name__):
        plan_kv_cache(gemma_config, budget_bytes=2**28, block_size=16, dtype_bytes=2, max_num_seqs=2,
                      max_num_batched_tokens=256)
    assert any("sliding_attention 15 layers" in r.message for r in caplog.records)
