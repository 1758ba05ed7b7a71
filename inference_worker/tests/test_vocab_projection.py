"""``vocab_projection``: the CPU float32 path computes ``linear``'s product (another summation order), in
``linear``'s shape and layout, for every row count; other dtypes take ``linear`` itself."""

from __future__ import annotations

import pytest
import torch

from inference_worker.model.transformer import vocab_projection


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 17])
def test_float32_on_cpu_matches_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(5000, 64, generator=gen)
    hidden = torch.randn(rows, 64, generator=gen)
    got = vocab_projection(hidden, weight)
    expected = torch.nn.functional.linear(hidden, weight)
    assert got.shape == (rows, 5000) and got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))


def test_bfloat16_takes_linear_exactly():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 64, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(vocab_projection(hidden, weight), torch.nn.functional.linear(hidden, weight))


def test_inside_inference_mode_and_on_a_view():
    """The engine calls it under inference_mode on ``hidden[rows]`` (a gathered copy) and on slices."""
    weight = torch.randn(1000, 32)
    hidden = torch.randn(6, 32)
    with torch.inference_mode():
        got = vocab_projection(hidden[1:4], weight)
    torch.testing.assert_close(got, torch.nn.functional.linear(hidden[1:4], weight), rtol=1e-5, atol=1e-5)
