"""Prefill/decode hand-off as a KV connector (:mod:`~inference_worker.engine.kv_connector`).

Every method runs on the engine's thread (the only thread that writes engine tensors); received KV
arrives as CPU tensors with the request and is copied into blocks here.

Export (prefill role): a request added with ``kv_export=True`` runs its prefill and samples its first
token; when it finishes (``max_tokens`` 1) ``request_finished`` — called by the scheduler while the
request's blocks are still allocated — copies, per layer, the KV the next decode step reads (full
layers: positions ``0..N-1``; sliding layers: ``N - min(N, W-1) .. N-1``, see
:mod:`inference_worker.kv_transfer.layout`) out of the paged cache; the engine hands it out with
``PagedLLMEngine.pop_exported_kv``.

Import (decode role): ``PagedLLMEngine.add_prefilled_request`` validates the received KV and queues
the request with its first token as output. At admission ``get_num_new_matched_tokens`` reports the N
prompt tokens as available externally, so the scheduler allocates blocks with ``num_computed_tokens ==
N`` (sliding groups get the null block for blocks wholly before the window of position N) in its
normal FCFS order, and ``start_load_kv`` writes the received K/V at their slots before the step that
decodes the first token. Per group the received KV starts at ``first_positions[g]``; a sliding
block holding an earlier position is only partly written and is never registered in the prefix cache.
The imported prompt is not looked up in the prefix cache (incremental hand-off is out of scope).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inference_worker.engine.kv_connector import ExternalKV, KVConnector
from inference_worker.engine.model_runner import PagedKVCache
from inference_worker.engine.request import Request, RequestStatus
from inference_worker.kernels.paged_attention import write_kv_to_cache
from inference_worker.kv_transfer.layout import KVLayout, transfer_tokens

if TYPE_CHECKING:
    from inference_worker.engine.llm_engine import PagedLLMEngine

KVList = list[tuple[torch.Tensor, torch.Tensor]]


def kv_layout(engine: PagedLLMEngine) -> KVLayout:
    """The transfer layout of ``engine``'s KV cache (model ``layer_types``, cache dtype)."""
    return KVLayout.from_model_config(engine.loaded.config, dtype=str(engine.core.dtype).removeprefix("torch."))


def _slots(block_table: Sequence[int], positions: range, block_size: int) -> torch.Tensor:
    """Cache slots ``block_table[p // bs] * bs + p % bs`` of ``positions``, int64 ``[len(positions)]``."""
    return torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in positions],
                        dtype=torch.int64)


@dataclass
class _Import:
    num_tokens: int
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    first_positions: Sequence[int]
    block_ids: tuple[list[int], ...] | None = None


class PDConnector(KVConnector):
    """The PD hand-off on the connector seam: exports after a prefill, imports before a decode.

    Args:
        kv_cache: the runner's paged KV tensors (read on export, written on import).
        layer_windows: per layer, its sliding window W or None (full attention).
    """

    def __init__(self, kv_cache: PagedKVCache, layer_windows: Sequence[int | None]) -> None:
        self.kv_cache = kv_cache
        self.layer_windows = list(layer_windows)
        self.num_groups = kv_cache.num_groups
        self._exports: set[str] = set()
        self._exported: dict[str, tuple[int, KVList]] = {}
        self._imports: dict[str, _Import] = {}
        self._to_load: list[_Import] = []

    # ---- engine API (engine thread) ------------------------------------------------------
    def expect_export(self, request_id: str) -> None:
        """Save ``request_id``'s KV when it finishes (not when aborted)."""
        self._exports.add(request_id)

    def pop_exported(self, request_id: str) -> tuple[int, KVList] | None:
        """``(N, kv)`` saved for ``request_id`` (see :meth:`save_kv`), once; None if nothing was saved."""
        self._exports.discard(request_id)
        return self._exported.pop(request_id, None)

    def validate_import(self, num_tokens: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                        first_positions: Sequence[int], num_kv_heads: int, head_dim: int) -> None:
        """Check received KV against a prefill of ``num_tokens`` tokens on this model.

        Raises:
            ValueError: wrong layer count, first positions or shapes.
        """
        if len(kv) != len(self.layer_windows) or len(first_positions) != len(self.layer_windows):
            raise ValueError(f"KV for {len(kv)} layers, the model has {len(self.layer_windows)}")
        for layer, ((k, v), first, w) in enumerate(zip(kv, first_positions, self.layer_windows, strict=True)):
            rows = transfer_tokens(num_tokens, w)
            shape = (rows, num_kv_heads, head_dim)
            if first != num_tokens - rows or tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"layer {layer}: KV {tuple(k.shape)} from position {first} does not fit a prefill "
                                 f"of {num_tokens} tokens (expected {shape} from {num_tokens - rows})")

    def expect_import(self, request_id: str, num_tokens: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      first_positions: Sequence[int]) -> None:
        """Queue received KV (validated) for ``request_id``; it is loaded when the request is admitted."""
        self._imports[request_id] = _Import(num_tokens, kv, list(first_positions))

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalKV | None:
        """An import waiting for admission: its N prompt tokens; per group the first position received."""
        pending = self._imports.get(request.request_id)
        if pending is None:
            return None
        firsts = [pending.num_tokens] * self.num_groups
        for layer, first in enumerate(pending.first_positions):
            g = self.kv_cache.layer_to_group[layer]
            firsts[g] = min(firsts[g], first)
        return ExternalKV(pending.num_tokens - num_computed_tokens, tuple(firsts))

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 external: ExternalKV) -> None:
        """Blocks are allocated: load the request's KV before this step's forward."""
        pending = self._imports.pop(request.request_id)
        pending.block_ids = block_ids
        self._to_load.append(pending)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        """Save the KV of an export request that finished normally; forget a never admitted import."""
        self._imports.pop(request.request_id, None)
        if request.request_id in self._exports:
            self._exports.discard(request.request_id)
            if request.status != RequestStatus.FINISHED_ABORTED:
                self.save_kv(request, block_ids)

    # ---- runner side ---------------------------------------------------------------------
    @torch.inference_mode()
    def start_load_kv(self) -> None:
        """Write every admitted import's K/V at its slots (synchronous copies on the engine thread)."""
        cache = self.kv_cache
        for pending in self._to_load:
            for layer, ((k, v), first) in enumerate(zip(pending.kv, pending.first_positions, strict=True)):
                g = cache.layer_to_group[layer]
                k_cache, v_cache = cache.k_caches[layer], cache.v_caches[layer]
                slots = _slots(pending.block_ids[g], range(first, pending.num_tokens), cache.block_size)
                write_kv_to_cache(k.to(k_cache.device, k_cache.dtype), v.to(v_cache.device, v_cache.dtype),
                                  k_cache, v_cache, slots.to(k_cache.device))
        self._to_load.clear()

    def save_kv(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        """Copy out, per layer, the KV a decode of ``request``'s prompt reads: ``[rows, Hkv, D]`` on CPU.

        Raises:
            ValueError: the request's prompt is not all computed.
        """
        n = request.num_prompt_tokens
        if request.num_computed_tokens < n:
            raise ValueError(f"request {request.request_id!r} is not at the end of its prefill "
                             f"({request.num_computed_tokens} of {n} tokens computed)")
        cache, kv = self.kv_cache, []
        for layer, window in enumerate(self.layer_windows):
            g = cache.layer_to_group[layer]
            slots = _slots(block_ids[g], range(n - transfer_tokens(n, window), n), cache.block_size)
            k_cache, v_cache = cache.k_caches[layer], cache.v_caches[layer]
            flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
            flat_v = v_cache.view(-1, *v_cache.shape[2:])
            slots = slots.to(k_cache.device)
            kv.append((flat_k.index_select(0, slots).cpu(), flat_v.index_select(0, slots).cpu()))
        self._exported[request.request_id] = (n, kv)


def connector_for(kv_cache: PagedKVCache, model_config: Any) -> PDConnector:
    """The engine's connector for ``model_config``'s layers (``layer_types``, ``sliding_window``)."""
    windows = [model_config.sliding_window if t == "sliding_attention" else None for t in model_config.layer_types]
    return PDConnector(kv_cache, windows)
