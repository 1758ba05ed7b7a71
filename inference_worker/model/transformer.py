"""Decoder-only causal LM for Gemma 3 (text) and Llama, with per-layer attention type.

Module and parameter names match the HF checkpoints (``model.layers.{i}.self_attn.q_proj.weight`` ...),
so HF safetensors load with ``load_state_dict(strict=True)``. Architecture differences are confined to:

* Gemma 3: embeddings scaled by ``sqrt(hidden_size)`` in the compute dtype; ``(1 + w)`` RMSNorms;
  q/k norms; four norms per layer (input, post-attention, pre-feed-forward, post-feed-forward);
  GELU-tanh MLP; RoPE base per layer type; optional final logit soft-cap.
* Llama: plain RMSNorm, two norms per layer, SiLU MLP, one RoPE base.

A Qwen2/Mistral-style model is a small addition (attention bias / sliding window on all layers are
already config fields).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inference_worker.config import LAYER_TYPES, ModelConfig
from inference_worker.model.attention import Attention, AttentionBackend
from inference_worker.model.layers import GatedMLP, RMSNorm, rope_cos_sin, rope_inv_freq


def vocab_projection(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T``: ``[n, hidden_size] x [vocab_size, hidden_size] -> [n, vocab_size]``.

    On a CPU in float32 it is computed as ``(weight @ hidden.T).T``, one row doubled to two: the same products
    in another summation order (max abs difference about 3e-6 in the logits; the parity tests' greedy tokens are
    unchanged), and on this project's CPU build (torch 2.13 CPU, 2 threads) several times faster for the few rows
    of a decode step. ``linear`` with 1-3 rows streams the ``vocab x hidden`` weight once per row, the transposed product once for
    all of them. Gemma 3 270M's tied 262144 x 640 head, 1/2/3/4 rows: 60/136/205/110 ms with ``linear``,
    30/20/30/29 ms here; its engine decode step at B = 1..4: 1.65x, 2.24x, 2.60x, 1.82x faster
    (``bench/lm_head.py``, ``bench/results/lm_head.json``). bfloat16 keeps ``linear``, the faster of the two there.
    """
    if hidden.device.type != "cpu" or weight.dtype != torch.float32 or hidden.dtype != torch.float32:
        return torch.nn.functional.linear(hidden, weight)
    rows = hidden.shape[0]
    if rows == 1:  # one column takes the matrix-vector path, which streams the weight as slowly as linear
        return torch.mm(weight, hidden.repeat(2, 1).T)[:, :1].T.contiguous()
    return torch.mm(weight, hidden.T).T.contiguous()


class DecoderLayer(nn.Module):
    """Pre-norm residual block; Gemma adds post-norms around attention and MLP ("sandwich" norms)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.gemma = config.architecture == "gemma3"
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=self.gemma)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=self.gemma)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, attn_metadata: Any) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, backend, attn_metadata)
        if self.gemma:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF ``model.*``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=config.architecture == "gemma3")


class CausalLM(nn.Module):
    """The full model: ``forward`` runs the decoder over a flat batch of tokens, ``compute_logits`` the head.

    Args:
        config: the architecture.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # RoPE inverse frequencies per layer type; plain tensors (not buffers) so that a model built on the
        # meta device and loaded with assign=True still has them. Tiny: [head_dim // 2] each.
        self.inv_freq = {
            layer_type: rope_inv_freq(config.head_dim, config.rope_base(layer_type), config.rope_scaling(layer_type))
            for layer_type in LAYER_TYPES
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: ``[num_tokens]`` int64, the tokens of this step (all sequences, flattened).
            positions: ``[num_tokens]`` int64 absolute positions (for RoPE).
            backend / attn_metadata: KV storage and its description of this step (see ``attention.py``).

        Returns:
            ``[num_tokens, hidden_size]`` in the weights' dtype.

        Raises:
            ValueError: ``input_ids`` and ``positions`` differ in shape or are not 1-D.
        """
        if input_ids.dim() != 1 or input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D of equal length; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        embed = self.model.embed_tokens
        x = embed(input_ids)  # [T, hidden]
        if self.config.architecture == "gemma3":
            # Gemma scales embeddings by sqrt(hidden_size), rounded to the compute dtype (Gemma reference code).
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        tables = {
            layer_type: rope_cos_sin(positions, self.inv_freq[layer_type], x.dtype)
            for layer_type in set(self.config.layer_types)
        }  # layer_type -> (cos, sin), each [T, head_dim]
        for layer, layer_type in zip(self.model.layers, self.config.layer_types, strict=True):
            cos, sin = tables[layer_type]
            x = layer(x, cos, sin, backend, attn_metadata)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` (float32) from hidden states ``[n, hidden_size]``; applies the final soft-cap."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        logits = vocab_projection(hidden, weight).float()  # [n, vocab]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
