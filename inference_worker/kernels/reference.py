"""Pure-torch reference attention over a contiguous KV cache (the ground truth for fast paths).

Layout (one sequence per batch row, key ``j`` of a row sits at absolute position ``j``):

* ``q``: ``[batch, num_q_tokens, num_heads, head_dim]`` with absolute positions ``q_positions``
  ``[batch, num_q_tokens]``;
* ``k_cache``/``v_cache``: ``[batch, max_kv_len, num_kv_heads, head_dim]``, of which the first
  ``kv_lens[b]`` rows are valid;
* GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (HF ``repeat_kv`` order).

Mask: key ``j`` is visible to a query at position ``i`` iff ``j < kv_lens[b]`` and ``j <= i`` and,
with a window ``W``, ``j > i - W`` (HF's convention: W keys including the query's own).
Scores are computed in float32 with an explicit softmax; an optional Gemma 2 style soft-cap
``cap * tanh(s / cap)`` is applied before masking.
"""

from __future__ import annotations

import torch


def attention_mask(
    q_positions: torch.Tensor, kv_lens: torch.Tensor, max_kv_len: int, sliding_window: int | None
) -> torch.Tensor:
    """Boolean visibility mask ``[batch, num_q_tokens, max_kv_len]`` (True = attend).

    Args:
        q_positions: ``[batch, num_q_tokens]`` int64 absolute query positions.
        kv_lens: ``[batch]`` int64 number of valid cache rows.
        max_kv_len: width of the cache.
        sliding_window: W in tokens, or None for full attention.

    Raises:
        ValueError: ``sliding_window`` is not positive.
    """
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    j = torch.arange(max_kv_len, device=q_positions.device)  # [max_kv_len]
    i = q_positions.unsqueeze(-1)  # [batch, num_q_tokens, 1]
    mask = (j <= i) & (j < kv_lens.view(-1, 1, 1))
    if sliding_window is not None:
        mask &= j > i - sliding_window
    return mask


def validate_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    q_positions: torch.Tensor, kv_lens: torch.Tensor) -> None:
    """Check the shared argument contract of every kernel.

    Raises:
        ValueError: mismatched ranks/shapes, a head count not divisible by the KV head count, or a query
            that would see no key (position beyond its row's ``kv_lens``).
    """
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [B, Tq, H, D] and k/v caches [B, Tk, Hkv, D] of equal shape; got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, num_q, num_heads, head_dim = q.shape
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if tuple(q_positions.shape) != (batch, num_q) or tuple(kv_lens.shape) != (batch,):
        raise ValueError(
            f"q_positions must be [{batch}, {num_q}] and kv_lens [{batch}]; got "
            f"{tuple(q_positions.shape)} and {tuple(kv_lens.shape)}"
        )


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_positions: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` over the cache with the causal (+ window) mask; returns ``[B, Tq, H, D]`` in q's dtype.

    ``scale`` multiplies ``q @ k^T`` (e.g. ``head_dim ** -0.5``). Rows whose query sees no key (padding)
    return zeros. See the module docstring for shapes and the mask.
    """
    validate_shapes(q, k_cache, v_cache, q_positions, kv_lens)
    num_heads, num_kv_heads = q.shape[2], k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache.float().repeat_interleave(group, dim=2)  # [B, Tk, H, D]
    v = v_cache.float().repeat_interleave(group, dim=2)  # [B, Tk, H, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale  # [B, H, Tq, Tk]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = attention_mask(q_positions, kv_lens, k_cache.shape[1], sliding_window)  # [B, Tq, Tk]
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    weights = torch.exp(scores - row_max)  # [B, H, Tq, Tk]; exp(-inf) = 0 for masked keys
    denom = weights.sum(dim=-1, keepdim=True)
    weights = weights / denom.clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v)  # [B, Tq, H, D]
    return out.to(q.dtype)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One new token per row: ``q`` ``[B, H, D]`` at position ``kv_lens - 1`` (its own KV already written).

    Returns ``[B, H, D]``.

    Raises:
        ValueError: ``q`` is not 3-D, or a ``kv_lens`` entry is < 1.
    """
    if q.dim() != 3:
        raise ValueError(f"decode q must be [B, H, D], got {tuple(q.shape)}")
    if bool((kv_lens < 1).any()):
        raise ValueError("decode needs kv_lens >= 1 (the new token's KV must be in the cache)")
    positions = (kv_lens - 1).view(-1, 1)  # [B, 1]
    out = prefill_attention_reference(q.unsqueeze(1), k_cache, v_cache, positions, kv_lens, scale=scale,
                                      sliding_window=sliding_window, softcap=softcap)
    return out.squeeze(1)
