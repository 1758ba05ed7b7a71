"""Fast attention path: ``torch.nn.functional.scaled_dot_product_attention`` over a contiguous KV cache.

Same arguments, shapes and mask as :mod:`inference_worker.kernels.reference` (which it is tested
against). Decode folds the query heads that share a KV head into SDPA's query axis. For a sliding window the keys that can be visible to any query are cut to the slice
``[min(q_positions) - W + 1, max_kv_len)`` before calling SDPA, so a decode step on a long sequence
touches only W keys of a sliding layer. GQA uses SDPA's ``enable_gqa`` (KV heads are not copied).
A soft-cap cannot be expressed in SDPA; with ``softcap`` set this path falls back to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias

from inference_worker.kernels.reference import (
    attention_mask,
    prefill_attention_reference,
    validate_shapes,
)


def prefill_attention_sdpa(
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
    """SDPA equivalent of :func:`~inference_worker.kernels.reference.prefill_attention_reference`.

    Returns ``[B, Tq, H, D]``. Rows whose query sees no key return zeros.
    """
    if softcap is not None:
        return prefill_attention_reference(q, k_cache, v_cache, q_positions, kv_lens, scale=scale,
                                           sliding_window=sliding_window, softcap=softcap)
    validate_shapes(q, k_cache, v_cache, q_positions, kv_lens)
    start = 0
    if sliding_window is not None:
        # Keys before the oldest position any query can see are never visible: drop them. This is a
        # host sync (int()); callers in a CUDA graph should pass an already-trimmed cache instead.
        start = max(0, int(q_positions.min()) - sliding_window + 1)
    k = k_cache[:, start:]  # [B, Tk', Hkv, D]
    v = v_cache[:, start:]
    mask = attention_mask(q_positions - start, kv_lens - start, k.shape[1], sliding_window)  # [B, Tq, Tk']
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [B, H, Tq, D]
        k.transpose(1, 2),  # [B, Hkv, Tk', D]
        v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),  # [B, 1, Tq, Tk']
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # [B, H, Tq, D]
    out = out.transpose(1, 2)  # [B, Tq, H, D]
    # SDPA returns NaN for a fully masked row; the contract (as in the reference) is zeros.
    visible = mask.any(dim=-1)  # [B, Tq]
    return torch.where(visible[..., None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def decode_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA equivalent of :func:`~inference_worker.kernels.reference.decode_attention_reference`.

    ``q`` is ``[B, H, D]`` at position ``kv_lens - 1``; returns ``[B, H, D]``.

    Raises:
        ValueError: ``q`` is not 3-D, or a ``kv_lens`` entry is < 1.
    """
    if q.dim() != 3:
        raise ValueError(f"decode q must be [B, H, D], got {tuple(q.shape)}")
    if bool((kv_lens < 1).any()):
        raise ValueError("decode needs kv_lens >= 1 (the new token's KV must be in the cache)")
    if softcap is not None:
        positions = (kv_lens - 1).view(-1, 1)  # [B, 1]
        return prefill_attention_reference(q.unsqueeze(1), k_cache, v_cache, positions, kv_lens, scale=scale,
                                           sliding_window=sliding_window, softcap=softcap).squeeze(1)
    validate_shapes(q.unsqueeze(1), k_cache, v_cache, (kv_lens - 1).view(-1, 1), kv_lens)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # GQA folded into the query axis: the ``group`` query heads that share a KV head are ``group`` queries
    # of that head at the same position, so SDPA reads each KV head once instead of once per query head.
    # Query head h uses KV head h // group (HF's repeat_kv order), hence the [B, Hkv, group, D] view.
    start = 0
    if sliding_window is not None:
        start = max(0, int(kv_lens.min()) - sliding_window)  # keys no row can see (host sync, as above)
    k = k_cache[:, start:]  # [B, Tk', Hkv, D]
    v = v_cache[:, start:]
    j = torch.arange(start, start + k.shape[1], device=q.device)  # absolute key positions [Tk']
    visible = j < kv_lens.view(-1, 1)  # [B, Tk']: the query at position kv_len - 1 sees keys j <= kv_len - 1
    if sliding_window is not None:
        visible &= j > (kv_lens.view(-1, 1) - 1 - sliding_window)
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, group, head_dim),  # [B, Hkv, group, D]
        k.transpose(1, 2),  # [B, Hkv, Tk', D]
        v.transpose(1, 2),
        attn_mask=visible.view(batch, 1, 1, -1),  # same keys for every head and group member
        scale=scale,
    )  # [B, Hkv, group, D]; every row sees at least its own key, so no NaN rows
    return out.reshape(batch, num_heads, head_dim)
