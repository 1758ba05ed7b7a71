"""Fast attention path (SDPA) against the pure-torch reference, and the reference against the definition."""

import pytest
import torch

from inference_worker.kernels import (
    decode_attention_reference,
    decode_attention_sdpa,
    prefill_attention_reference,
    prefill_attention_sdpa,
)
from inference_worker.kernels.reference import attention_mask

torch.set_num_threads(1)
W = 8
HEAD_DIM = 16


def _inputs(batch, num_q, num_kv_heads, group, kv_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_q, num_kv_heads * group, HEAD_DIM, generator=gen)
    k = torch.randn(batch, kv_len, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(batch, kv_len, num_kv_heads, HEAD_DIM, generator=gen)
    return q, k, v


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, W])
@pytest.mark.parametrize("length", [W - 1, W, W + 1, 3 * W])
def test_prefill_sdpa_matches_reference(group, window, length):
    q, k, v = _inputs(2, length, 2, group, length + 3)  # cache wider than the valid rows
    positions = torch.arange(length).expand(2, length)
    kv_lens = torch.tensor([length, length])
    scale = HEAD_DIM**-0.5
    ref = prefill_attention_reference(q, k, v, positions, kv_lens, scale=scale, sliding_window=window)
    fast = prefill_attention_sdpa(q, k, v, positions, kv_lens, scale=scale, sliding_window=window)
    assert fast.shape == (2, length, 2 * group, HEAD_DIM)
    assert (fast - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, W])
@pytest.mark.parametrize("length", [W - 1, W, W + 1, 3 * W])
def test_decode_sdpa_matches_reference_with_ragged_lengths(group, window, length):
    q, k, v = _inputs(3, 1, 2, group, 3 * W + 2, seed=1)
    kv_lens = torch.tensor([length, 1, 3 * W + 2])
    scale = 0.3
    ref = decode_attention_reference(q[:, 0], k, v, kv_lens, scale=scale, sliding_window=window)
    fast = decode_attention_sdpa(q[:, 0], k, v, kv_lens, scale=scale, sliding_window=window)
    assert fast.shape == (3, 2 * group, HEAD_DIM)
    assert (fast - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("window", [None, W])
def test_chunked_prefill_continuation_matches_reference(window):
    # second chunk of a prompt: queries at positions 10..19 over a cache holding 20 tokens
    q, k, v = _inputs(1, 10, 1, 4, 24, seed=2)
    positions = torch.arange(10, 20).view(1, 10)
    kv_lens = torch.tensor([20])
    ref = prefill_attention_reference(q, k, v, positions, kv_lens, scale=0.25, sliding_window=window)
    fast = prefill_attention_sdpa(q, k, v, positions, kv_lens, scale=0.25, sliding_window=window)
    assert (fast - ref).abs().max().item() <= 1e-4


def test_window_convention_is_hf_query_sees_w_keys_including_itself():
    mask = attention_mask(torch.arange(6).view(1, 6), torch.tensor([6]), 6, sliding_window=3)[0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_reference_decode_equals_hand_computed_softmax_over_window():
    q, k, v = _inputs(1, 1, 1, 3, 10, seed=3)
    out = decode_attention_reference(q[:, 0], k, v, torch.tensor([10]), scale=0.5, sliding_window=4)
    head = 2  # any query head reads the single KV head
    keys = k[0, 6:10, 0]  # positions 6..9 are the last 4
    scores = (keys @ q[0, 0, head]) * 0.5
    expected = torch.softmax(scores, dim=0) @ v[0, 6:10, 0]
    assert (out[0, head] - expected).abs().max().item() <= 1e-6


def test_softcap_applies_tanh_before_softmax_and_falls_back():
    q, k, v = _inputs(1, 1, 1, 1, 5, seed=4)
    q = q * 20
    cap = 2.0
    out = decode_attention_sdpa(q[:, 0], k, v, torch.tensor([5]), scale=1.0, softcap=cap)
    scores = cap * torch.tanh((k[0, :, 0] @ q[0, 0, 0]) / cap)
    expected = torch.softmax(scores, dim=0) @ v[0, :, 0]
    assert (out[0, 0] - expected).abs().max().item() <= 1e-5
    assert float(scores.abs().max()) <= cap


def test_padding_query_rows_return_zeros_not_nan():
    q, k, v = _inputs(1, 3, 1, 2, 4, seed=5)
    positions = torch.tensor([[0, 1, 7]])  # third query is padding beyond kv_len
    for fn in (prefill_attention_reference, prefill_attention_sdpa):
        out = fn(q, k, v, positions, torch.tensor([2]), scale=0.1, sliding_window=4)
        assert torch.equal(out[0, 2], torch.zeros(2, HEAD_DIM))
        assert not torch.isnan(out).any()


def test_invalid_shapes_raise():
    q, k, v = _inputs(1, 2, 2, 1, 4)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        prefill_attention_sdpa(q[:, :, :1].expand(1, 2, 3, HEAD_DIM), k, v, torch.zeros(1, 2, dtype=torch.long),
                               torch.tensor([4]), scale=1.0)
    with pytest.raises(ValueError, match="kv_lens >= 1"):
        decode_attention_sdpa(q[:, 0], k, v, torch.tensor([0]), scale=1.0)
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        prefill_attention_reference(q, k, v, torch.zeros(1, 2, dtype=torch.long), torch.tensor([4]), scale=1.0,
                                    sliding_window=0)
