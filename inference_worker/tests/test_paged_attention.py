"""Paged attention (reference and fast path) matches the contiguous reference kernel, window and GQA included."""

import pytest
import torch

from inference_worker.kernels.paged_attention import (
    PagedAttentionMetadata,
    paged_attention,
    paged_attention_reference,
    write_kv_to_cache,
)
from inference_worker.kernels.reference import prefill_attention_reference

torch.set_num_threads(1)
W = 8
BS = 4
D = 16


def build_batch(requests, num_heads, num_kv_heads, sliding_window, seed=0):
    """requests: list of (seq_len, query_len). Returns q, caches, metadata and contiguous K/V per request.

    Blocks are handed out in a shuffled order; unused blocks and the null block hold large garbage,
    and (with a window) blocks wholly before the window are replaced by the null block, as the
    sliding-window manager does.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-s // BS) for s, _ in requests)
    k_cache = torch.randn(num_blocks, BS, num_kv_heads, D, generator=gen) * 100
    v_cache = torch.randn(num_blocks, BS, num_kv_heads, D, generator=gen) * 100
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(-(-s // BS) for s, _ in requests)
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int64)
    qs, slots, contiguous = [], [], []
    for r, (seq_len, query_len) in enumerate(requests):
        n = -(-seq_len // BS)
        ids = [order.pop() for _ in range(n)]
        k = torch.randn(seq_len, num_kv_heads, D, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, D, generator=gen)
        positions = torch.arange(seq_len)
        slot = torch.tensor(ids)[positions // BS] * BS + positions % BS
        write_kv_to_cache(k, v, k_cache, v_cache, slot)
        if sliding_window is not None:
            first = max(0, seq_len - query_len - sliding_window + 1) // BS
            ids[:first] = [0] * first
        block_table[r, :n] = torch.tensor(ids)
        qs.append(torch.randn(query_len, num_heads, D, generator=gen))
        slots.append(slot[seq_len - query_len :])
        contiguous.append((k, v))
    num_decodes = sum(1 for _, q in requests if q == 1)
    meta = PagedAttentionMetadata(
        block_size=BS,
        query_lens=[q for _, q in requests],
        seq_lens=[s for s, _ in requests],
        block_table=block_table,
        slot_mapping=torch.cat(slots),
        num_decodes=num_decodes,
    )
    return torch.cat(qs), k_cache, v_cache, meta, contiguous


def contiguous_reference(q, meta, contiguous, sliding_window, scale):
    outs, start = [], 0
    for (k, v), query_len, seq_len in zip(contiguous, meta.query_lens, meta.seq_lens):
        positions = torch.arange(seq_len - query_len, seq_len).unsqueeze(0)
        outs.append(
            prefill_attention_reference(
                q[start : start + query_len].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), positions,
                torch.tensor([seq_len]), scale=scale, sliding_window=sliding_window,
            ).squeeze(0)
        )
        start += query_len
    return torch.cat(outs)


LENGTHS = [W - 1, W, W + 1, 3 * W]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("sliding_window", [None, W])
def test_paged_matches_contiguous_reference_for_decodes_and_prefill_chunks(num_heads, num_kv_heads, sliding_window):
    # decodes first (query_len 1) at every test length, then prefill chunks: whole prompts and a later chunk
    requests = [(n, 1) for n in LENGTHS] + [(n, n) for n in LENGTHS] + [(3 * W, W + 1), (W + 1, 2)]
    q, k_cache, v_cache, meta, contiguous = build_batch(requests, num_heads, num_kv_heads, sliding_window)
    expected = contiguous_reference(q, meta, contiguous, sliding_window, D**-0.5)
    reference = paged_attention_reference(q, k_cache, v_cache, meta, scale=D**-0.5, sliding_window=sliding_window)
    fast = paged_attention(q, k_cache, v_cache, meta, scale=D**-0.5, sliding_window=sliding_window)
    assert reference.shape == fast.shape == (sum(ql for _, ql in requests), num_heads, D)
    # the reference path over the window's blocks is bit-identical to the contiguous reference
    assert torch.equal(reference, expected)
    assert (fast - expected).abs().max().item() <= 1e-5


def test_write_kv_to_cache_places_tokens_by_slot():
    k_cache = torch.zeros(3, 2, 1, 2)
    v_cache = torch.zeros(3, 2, 1, 2)
    key = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]])
    write_kv_to_cache(key, -key, k_cache, v_cache, torch.tensor([5, 2, 3]))
    assert k_cache[:, :, 0, 0].tolist() == [[0.0, 0.0], [2.0, 3.0], [0.0, 1.0]]
    assert v_cache[:, :, 0, 0].tolist() == [[0.0, 0.0], [-2.0, -3.0], [0.0, -1.0]]


def test_metadata_validation():
    table = torch.zeros(2, 1, dtype=torch.int64)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="first num_decodes requests must have query_len 1"):
        PagedAttentionMetadata(4, [2, 1], [2, 1], table, slots, num_decodes=1)
    with pytest.raises(ValueError, match="1 <= query_len <= seq_len"):
        PagedAttentionMetadata(4, [3], [2], table[:1], slots, num_decodes=0)


def test_fast_path_scratch_buffers_work_in_and_out_of_inference_mode_and_across_batch_sizes():
    """The fast path gathers into reused per-thread buffers: a buffer made under inference mode must not be
    written outside it (RuntimeError before the fix), and a smaller batch after a larger one must not read
    the larger batch's leftovers."""
    from inference_worker.kernels import paged_attention as module

    module._BUFFERS.buffers.clear()  # start as a fresh engine thread does: the first gather is under inference mode
    big = build_batch([(n, 1) for n in LENGTHS] + [(3 * W, W + 1)], 4, 1, W)
    small = build_batch([(W - 1, 1), (W + 1, 2)], 4, 1, W)
    for mode in (True, False, True):
        for q, k_cache, v_cache, meta, contiguous in (big, small):
            with torch.inference_mode(mode):
                fast = paged_attention(q, k_cache, v_cache, meta, scale=D**-0.5, sliding_window=W)
            expected = contiguous_reference(q, meta, contiguous, W, D**-0.5)
            assert (fast - expected).abs().max().item() <= 1e-5
