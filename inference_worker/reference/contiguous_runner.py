"""Model runner over a contiguous KV cache: one cache row ("slot") per running sequence.

This is the simple, obviously-correct reference runner (test code: the paged runner serves, and is
compared with this one). It runs under :class:`~inference_worker.reference.contiguous_engine.ContiguousLLMEngine`.
Every layer keeps
``k``/``v`` tensors ``[max_num_seqs, capacity, num_kv_heads, head_dim]``; token ``j`` of the sequence in
slot ``s`` is row ``[s, j]``. Capacity grows (doubling, capped at ``max_model_len``) as sequences get
longer. Sliding layers keep every token here too (the window is applied by the attention mask); freeing
out-of-window KV is the paged cache's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_worker.kernels import (
    decode_attention_reference,
    decode_attention_sdpa,
    prefill_attention_reference,
    prefill_attention_sdpa,
)
from inference_worker.model.transformer import CausalLM

_KERNELS = {
    "sdpa": (prefill_attention_sdpa, decode_attention_sdpa),
    "reference": (prefill_attention_reference, decode_attention_reference),
}
_CAPACITY_ALIGN = 256


@dataclass(frozen=True)
class ContiguousAttentionMetadata:
    """Which sequence each token of a step belongs to (tokens are ordered sequence by sequence).

    Attributes:
        slots: cache row of each sequence.
        query_lens: new tokens of each sequence in this step (all 1 for a decode step).
        context_lens: tokens of each sequence already in the cache before this step.
        slot_index: ``[num_tokens]`` int64 cache row of each token.
        positions: ``[num_tokens]`` int64 absolute position of each token (= its cache column).
        kv_lens: ``[num_seqs]`` int64 ``context_lens + query_lens``.
    """

    slots: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    slot_index: torch.Tensor
    positions: torch.Tensor
    kv_lens: torch.Tensor

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token."""
        return all(n == 1 for n in self.query_lens)

    @classmethod
    def build(cls, slots: list[int], query_lens: list[int], context_lens: list[int],
              device: torch.device | str = "cpu") -> ContiguousAttentionMetadata:
        """Build the tensors from per-sequence lists.

        Raises:
            ValueError: lists of different lengths, or a query length < 1.
        """
        if not (len(slots) == len(query_lens) == len(context_lens)) or not slots:
            raise ValueError("slots, query_lens and context_lens must be non-empty and of equal length")
        if min(query_lens) < 1:
            raise ValueError(f"every query length must be >= 1, got {query_lens}")
        slot_index = torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in zip(slots, query_lens, strict=True)])
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, query_lens, strict=True)])
        kv_lens = torch.tensor([c + n for c, n in zip(context_lens, query_lens, strict=True)], dtype=torch.long)
        return cls(tuple(slots), tuple(query_lens), tuple(context_lens), slot_index.to(device),
                   positions.to(device), kv_lens.to(device))


class ContiguousKVCache:
    """The :class:`~inference_worker.model.attention.AttentionBackend` over contiguous per-slot KV rows.

    Args:
        num_layers, num_kv_heads, head_dim: cache geometry.
        max_num_seqs: number of slots.
        max_model_len: longest sequence (tokens) a slot can hold.
        dtype, device: storage of K/V.
        kernel: ``"sdpa"`` (fast path) or ``"reference"`` (pure torch).
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, max_num_seqs: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device | str, kernel: str = "sdpa") -> None:
        if kernel not in _KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {sorted(_KERNELS)}")
        self.num_layers = num_layers
        self.shape_tail = (num_kv_heads, head_dim)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.prefill_kernel, self.decode_kernel = _KERNELS[kernel]
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure_capacity(self, num_tokens: int) -> None:
        """Make every slot able to hold ``num_tokens`` tokens (grows by doubling, copies existing KV).

        Raises:
            ValueError: ``num_tokens`` exceeds ``max_model_len``.
        """
        if num_tokens > self.max_model_len:
            raise ValueError(f"sequence of {num_tokens} tokens exceeds max_model_len {self.max_model_len}")
        if num_tokens <= self.capacity:
            return
        aligned = -(-num_tokens // _CAPACITY_ALIGN) * _CAPACITY_ALIGN
        new_capacity = min(self.max_model_len, max(aligned, 2 * self.capacity))
        shape = (self.max_num_seqs, new_capacity, *self.shape_tail)
        for store in (self.k, self.v):
            old = list(store)
            store.clear()
            for layer in range(self.num_layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old:
                    grown[:, : self.capacity] = old[layer]
                store.append(grown)
        self.capacity = new_capacity

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata: ContiguousAttentionMetadata, *, scale: float, sliding_window: int | None,
               softcap: float | None) -> torch.Tensor:
        """Write this step's K/V at ``[slot, position]`` and attend; ``q`` ``[T, H, D]`` -> ``[T, H, D]``."""
        md = attn_metadata
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]  # [max_num_seqs, capacity, Hkv, D]
        k_cache[md.slot_index, md.positions] = k.to(self.dtype)
        v_cache[md.slot_index, md.positions] = v.to(self.dtype)
        kw = {"scale": scale, "sliding_window": sliding_window, "softcap": softcap}
        max_kv = int(max(c + n for c, n in zip(md.context_lens, md.query_lens, strict=True)))
        if md.is_decode:
            rows = _rows(md.slots, self.device)
            out = self.decode_kernel(q, _take(k_cache, rows, max_kv), _take(v_cache, rows, max_kv), md.kv_lens, **kw)
            return out  # [S, H, D] == [T, H, D]
        outputs, start = [], 0
        for i, (slot, n) in enumerate(zip(md.slots, md.query_lens, strict=True)):
            kv_len = md.context_lens[i] + n
            out = self.prefill_kernel(
                q[start : start + n].unsqueeze(0),  # [1, n, H, D]
                k_cache[slot : slot + 1, :kv_len],  # [1, kv_len, Hkv, D]
                v_cache[slot : slot + 1, :kv_len],
                md.positions[start : start + n].unsqueeze(0),  # [1, n]
                md.kv_lens[i : i + 1],
                **kw,
            )
            outputs.append(out[0])
            start += n
        return torch.cat(outputs, dim=0)


def _rows(slots: tuple[int, ...], device: torch.device) -> slice | torch.Tensor:
    """A slice when the slots are consecutive (no copy), otherwise an index tensor."""
    if list(slots) == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, dtype=torch.long, device=device)


def _take(cache: torch.Tensor, rows: slice | torch.Tensor, max_kv: int) -> torch.Tensor:
    return cache[rows, :max_kv] if isinstance(rows, slice) else cache.index_select(0, rows)[:, :max_kv]


class ContiguousModelRunner:
    """Runs prefill and decode steps of a :class:`CausalLM` over a :class:`ContiguousKVCache`.

    Args:
        model: the loaded model (its parameters' dtype/device are used for the cache).
        max_num_seqs: slots (concurrent sequences).
        max_model_len: longest sequence in tokens (default: the model's ``max_position_embeddings``).
        kernel: ``"sdpa"`` or ``"reference"``.
    """

    def __init__(self, model: CausalLM, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 kernel: str = "sdpa") -> None:
        cfg = model.config
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cache = ContiguousKVCache(
            num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, dtype=param.dtype,
            device=self.device, kernel=kernel,
        )
        self._free_slots = list(range(max_num_seqs))

    @property
    def num_free_slots(self) -> int:
        """Slots available for new sequences."""
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        """Reserve a cache row. Raises ``RuntimeError`` when all ``max_num_seqs`` slots are in use."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.max_num_seqs} slots are in use")
        return self._free_slots.pop(0)

    def free_slot(self, slot: int) -> None:
        """Return a cache row (its contents are overwritten by the next user)."""
        if slot in self._free_slots or not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"slot {slot} is not allocated")
        self._free_slots.append(slot)
        self._free_slots.sort()

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], *, context_len: int = 0) -> torch.Tensor:
        """Run ``token_ids`` (positions ``context_len ..``) for one sequence; return last-token logits ``[vocab]`` (fp32)."""
        return self._run([slot], [list(token_ids)], [context_len])[0]

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int], context_lens: list[int]) -> torch.Tensor:
        """One token per sequence; returns logits ``[num_seqs, vocab]`` (fp32)."""
        return self._run(slots, [[t] for t in token_ids], context_lens)

    def _run(self, slots: list[int], tokens: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        query_lens = [len(t) for t in tokens]
        self.cache.ensure_capacity(max(c + n for c, n in zip(context_lens, query_lens, strict=True)))
        md = ContiguousAttentionMetadata.build(slots, query_lens, context_lens, self.device)
        input_ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, md.positions, self.cache, md)  # [T, hidden]
        last = torch.cumsum(torch.tensor(query_lens, device=self.device), 0) - 1  # [S] last token of each seq
        return self.model.compute_logits(hidden[last])  # [S, vocab]
