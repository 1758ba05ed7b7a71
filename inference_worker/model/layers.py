"""Building blocks shared by the architectures: RMSNorm variants, rotary embeddings, gated MLP.

Numerics follow the HF reference implementations so that fp32 parity is exact up to kernel
reduction order: norms compute in float32 and cast back; RoPE frequencies are float32 and use the
"rotate half" (GPT-NeoX) layout that HF checkpoints expect.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    ``unit_offset=False`` (Llama): ``w * cast(x / rms(x))``. ``unit_offset=True`` (Gemma): ``cast((x / rms(x)) * (1 + w))``
    with the product in float32. ``rms(x) = sqrt(mean(x^2) + eps)``. Source: Zhang & Sennrich 2019; Gemma's
    ``(1 + w)`` parametrisation from the Gemma reference code (weights are stored as ``w``, zero-centred).
    """

    def __init__(self, dim: int, eps: float, *, unit_offset: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]`` -> same shape and dtype."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, base: float, scaling_factor: float = 1.0) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32): ``1 / base^(2i / head_dim) / scaling_factor``.

    Linear RoPE scaling divides the frequencies (equivalently the positions) by the factor.
    Source: Su et al. 2021 (RoFormer); linear scaling: Chen et al. 2023 (position interpolation).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (base**exponents) / scaling_factor


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[num_tokens, head_dim]`` for int positions ``[num_tokens]``, cast to ``dtype``."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [num_tokens, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by tables ``[num_tokens, head_dim]`` (rotate-half layout)."""
    cos = cos.unsqueeze(1)  # [num_tokens, 1, head_dim]
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [num_tokens, num_heads, head_dim]
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``act`` SiLU (Llama) or tanh-approximated GELU (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {activation!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        gate = self.gate_proj(x)
        if self.activation == "silu":
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))
