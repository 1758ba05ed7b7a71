"""The attention layer and the interface to whatever stores the KV cache.

The model never owns KV storage. Each forward receives an :class:`AttentionBackend` and an opaque
``attn_metadata`` object that the backend understands (slots and lengths for a contiguous cache, block
tables and slot mappings for a paged one). The layer computes q/k/v, applies its norms and RoPE, and
hands them to ``backend.attend``, which writes the new K/V into its cache and returns the attention
output. So a paged engine can replace the contiguous cache without touching the model, and there is
no module-level mutable state.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from inference_worker.config import ModelConfig
from inference_worker.model.layers import RMSNorm, apply_rope


class AttentionBackend(Protocol):
    """Stores K/V for every layer and computes attention over it."""

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: Any,
        *,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` of this step's tokens for layer ``layer_idx`` and attend.

        Args:
            q: ``[num_tokens, num_heads, head_dim]`` (RoPE applied).
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` (RoPE applied to k).
            attn_metadata: backend-specific description of which sequence each token belongs to.
            scale: multiplier of ``q @ k^T``.
            sliding_window: W for a sliding layer (query i sees keys i-W < j <= i), None for full attention.
            softcap: tanh soft-cap of scores, or None.

        Returns:
            ``[num_tokens, num_heads, head_dim]``.
        """
        ...


class Attention(nn.Module):
    """Multi-head attention with GQA, optional q/k RMSNorm (Gemma 3) and a per-layer window."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.layer_type = config.layer_types[layer_idx]
        # Gemma: scores scaled by query_pre_attn_scalar^-0.5; otherwise head_dim^-0.5 (Vaswani et al. 2017).
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.architecture == "gemma3":
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]``, RoPE tables ``[num_tokens, head_dim]`` -> ``[num_tokens, hidden]``."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = backend.attend(self.layer_idx, q, k, v, attn_metadata, scale=self.scale,
                             sliding_window=self.sliding_window, softcap=self.softcap)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
