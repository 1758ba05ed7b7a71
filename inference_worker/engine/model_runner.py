"""Model runner: owns every tensor of the paged engine (KV cache, inputs) and executes one step.

It consumes a ``SchedulerOutput``, keeps a ``CachedRequestState`` per request (token ids, block
tables per KV-cache group, sampler state), builds the flat batch (input ids, positions, slot
mappings, block tables), runs the model with ``PagedKVCache`` as its attention backend and
samples one token for every request whose known tokens are now all computed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inference_worker.engine.kv_cache_sizing import KVCachePlan
from inference_worker.engine.kv_connector import KVConnector
from inference_worker.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from inference_worker.kernels.paged_attention import (
    PagedAttentionMetadata,
    paged_attention,
    paged_attention_reference,
    write_kv_to_cache,
)

logger = logging.getLogger(__name__)


class PagedKVCache:
    """The paged KV tensors of every layer, and the model's attention backend over them.

    Each layer gets ``k``/``v`` tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` where
    ``num_blocks`` is its KV-cache group's pool size; block ids from that group's block table
    index them. ``attend`` receives, as ``attn_metadata``, one ``PagedAttentionMetadata`` per group.

    Args:
        plan: the sizing plan (groups, block size).
        num_kv_heads, head_dim: KV geometry.
        dtype, device: tensor placement.
        use_reference: run ``paged_attention_reference`` instead of the fast path (for tests).
    """

    def __init__(self, plan: KVCachePlan, *, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", use_reference: bool = False) -> None:
        self.block_size = plan.block_size
        self.num_groups = len(plan.groups)
        self.layer_to_group: dict[int, int] = {}
        self.k_caches: dict[int, torch.Tensor] = {}
        self.v_caches: dict[int, torch.Tensor] = {}
        for group_index, group in enumerate(plan.groups):
            for layer in group.layer_indices:
                self.layer_to_group[layer] = group_index
                shape = (group.num_blocks, plan.block_size, num_kv_heads, head_dim)
                self.k_caches[layer] = torch.zeros(shape, dtype=dtype, device=device)
                self.v_caches[layer] = torch.zeros(shape, dtype=dtype, device=device)
        self.attention = paged_attention_reference if use_reference else paged_attention

    @property
    def num_bytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.k_caches.values(), *self.v_caches.values()))

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata: list[PagedAttentionMetadata], *, scale: float, sliding_window: int | None,
               softcap: float | None) -> torch.Tensor:
        """Write this step's K/V into the layer's blocks and attend (``AttentionBackend`` protocol).

        ``q`` ``[num_tokens, H, D]``, ``k``/``v`` ``[num_tokens, Hkv, D]`` -> ``[num_tokens, H, D]``.
        """
        meta = attn_metadata[self.layer_to_group[layer_idx]]
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        write_kv_to_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attention(q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)


@dataclass
class CachedRequestState:
    """What the runner remembers about a request between steps.

    Attributes:
        request_id: the request's id.
        token_ids: prompt followed by every token sampled so far.
        num_prompt_tokens: prompt length.
        sampling_params: the engine's sampling parameters (opaque here, read by the sampler).
        block_ids: block table per KV-cache group (entries the scheduler nulled may be stale; the
            kernel never reads blocks outside the window).
        num_computed_tokens: tokens whose KV is in the cache.
        sampler_state: free slot for the sampler (e.g. a seeded ``torch.Generator``).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: Any
    block_ids: list[list[int]]
    num_computed_tokens: int
    sampler_state: Any = None
    output_token_ids: list[int] = field(default_factory=list)


SampleFn = Callable[[torch.Tensor, list[CachedRequestState]], list[int]]


def greedy_sampler(logits: torch.Tensor, states: list[CachedRequestState]) -> list[int]:
    """Argmax of each row of ``logits`` ``[n, vocab]`` (ties: lowest id, as ``torch.argmax``)."""
    return logits.argmax(dim=-1).tolist()


class ModelRunner:
    """Runs the model for one ``SchedulerOutput`` at a time.

    Args:
        model: a ``CausalLM`` (``forward(input_ids, positions, backend, attn_metadata)`` and
            ``compute_logits``).
        kv_cache: the paged KV tensors (also the attention backend).
        sampler: ``(logits [n, vocab] float32, states) -> token ids``; ``greedy_sampler`` by default.
        device: where inputs are built.
        connector: the KV connector whose runner side loads external KV before each forward.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, *, sampler: SampleFn = greedy_sampler,
                 device: torch.device | str = "cpu", connector: KVConnector | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.connector = connector or KVConnector()
        self.requests: dict[str, CachedRequestState] = {}
        self.last_logits: dict[str, torch.Tensor] = {}

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_req_ids:
            self.requests.pop(request_id, None)
        for request_id in out.preempted_req_ids:
            state = self.requests[request_id]
            state.block_ids = [[] for _ in state.block_ids]
            state.num_computed_tokens = 0
        for new in out.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=list(new.output_token_ids),
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            if cached.resumed_from_preemption:
                state.block_ids = [list(ids) for ids in cached.new_block_ids]
            else:
                for table, ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                    table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample; returns the sampled token per request that reached its end.

        Algorithm: update per-request state from the scheduler output; let the connector copy
        external KV of newly admitted requests into their blocks; order the scheduled
        requests single-token first (decodes, batched by the kernel) then longer chunks; for each
        request take tokens ``[num_computed, num_computed + n)`` of its token ids with those
        positions, and per group its block table row and each token's slot
        ``block_ids[pos // block_size] * block_size + pos % block_size``; run the model on the
        flat batch; compute logits only at the last token of requests whose tokens are now all
        computed, sample those, and append the sampled tokens to the states.
        """
        self._update_states(scheduler_output)
        self.connector.start_load_kv()
        self.connector.wait_for_load()
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        scheduled = scheduler_output.num_scheduled_tokens
        order = sorted(scheduled, key=lambda rid: scheduled[rid] != 1)  # stable: decodes first
        bs = self.block_size
        num_groups = self.kv_cache.num_groups
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        query_lens, seq_lens, sample_rows, sample_states = [], [], [], []
        for request_id in order:
            state = self.requests[request_id]
            n = scheduled[request_id]
            start = state.num_computed_tokens
            input_ids += state.token_ids[start : start + n]
            token_positions = range(start, start + n)
            positions += token_positions
            for g, table in enumerate(state.block_ids):
                slots[g] += [table[p // bs] * bs + p % bs for p in token_positions]
            query_lens.append(n)
            seq_lens.append(start + n)
            state.num_computed_tokens = start + n
            if start + n == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_states.append(state)
        metadata = []
        for g in range(num_groups):
            width = max(len(self.requests[rid].block_ids[g]) for rid in order)
            table = torch.zeros(len(order), width, dtype=torch.int64)
            for row, rid in enumerate(order):
                ids = self.requests[rid].block_ids[g]
                table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            metadata.append(
                PagedAttentionMetadata(
                    block_size=bs,
                    query_lens=query_lens,
                    seq_lens=seq_lens,
                    block_table=table.to(self.device),
                    slot_mapping=torch.tensor(slots[g], dtype=torch.int64, device=self.device),
                    num_decodes=sum(1 for q in query_lens if q == 1),
                )
            )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids_t, pos_t, self.kv_cache, metadata)  # [num_tokens, hidden]
        if not sample_rows:
            return ModelRunnerOutput()
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab] float32
        self.last_logits = {state.request_id: logits[i] for i, state in enumerate(sample_states)}
        tokens = self.sampler(logits, sample_states)
        sampled = {}
        for state, token in zip(sample_states, tokens, strict=True):
            state.token_ids.append(int(token))
            state.output_token_ids.append(int(token))
            sampled[state.request_id] = [int(token)]
        return ModelRunnerOutput(sampled_token_ids=sampled)
