"""Prefill/decode hand-off on the paged engine: export a prefilled request's KV, import it on decode.

Both functions run on the engine's own thread (the only thread that touches the engine).

Export (prefill role): a request added with ``max_tokens >= 2`` and no stop condition on its first
token is still running after the step that sampled its first token, with ``num_computed_tokens == N``
(the prompt) and its blocks held. :func:`export_prefill_kv` copies, per layer, the KV the next decode
step reads (full layers: positions ``0..N-1``; sliding layers: ``N - min(N, W-1) .. N-1``, see
:mod:`inference_worker.kv_transfer.layout`) out of the paged cache; the caller then aborts the request,
which frees its blocks.

Import (decode role): :func:`import_prefilled_request` registers the request with the engine as if
its prompt had just been prefilled here: it allocates blocks for positions ``0..N-1`` with
``allocate_slots(request_id, N, 0)`` (so sliding groups get the null block for blocks wholly before
the window of position N, and real blocks only for the last ``W-1`` positions), writes the received
K/V at their slots, appends the first token and puts the request in the running batch with
``num_computed_tokens == N``. The next step decodes the first token like any other decode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from inference_worker.engine.model_runner import CachedRequestState
from inference_worker.engine.outputs import RequestOutput
from inference_worker.engine.paged_engine import PagedLLMEngine
from inference_worker.engine.request import Request, RequestStatus
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.kernels.paged_attention import write_kv_to_cache
from inference_worker.kv_transfer.layout import KVLayout, transfer_tokens


class NoCapacity(Exception):
    """The decode engine has no free seat or blocks for an imported request right now."""


def kv_layout(engine: PagedLLMEngine) -> KVLayout:
    """The transfer layout of ``engine``'s KV cache (model ``layer_types``, cache dtype)."""
    return KVLayout.from_model_config(engine.loaded.config, dtype=str(engine.core.dtype).removeprefix("torch."))


def _slots(block_table: Sequence[int], positions: range, block_size: int) -> torch.Tensor:
    """Cache slots ``block_table[p // bs] * bs + p % bs`` of ``positions``, int64 ``[len(positions)]``."""
    return torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in positions],
                        dtype=torch.int64)


def export_prefill_kv(engine: PagedLLMEngine, request_id: str) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Copy the KV a decode step needs out of ``engine``'s paged cache.

    Returns:
        ``(N, kv)``: N prompt tokens computed, and per layer ``(K, V)`` copies on CPU, each
        ``[transfer_tokens(N, W_layer), num_kv_heads, head_dim]`` in the cache dtype.

    Raises:
        ValueError: the request is unknown, or not exactly at the end of its prefill (its computed
            tokens must be the prompt and its first token sampled but not yet computed).
    """
    core = engine.core
    request = core.scheduler.requests.get(request_id)
    if request is None or request.status != RequestStatus.RUNNING:
        raise ValueError(f"request {request_id!r} is not running; nothing to export")
    n = request.num_prompt_tokens
    if request.num_computed_tokens != n or request.num_output_tokens != 1:
        raise ValueError(f"request {request_id!r} is not at the end of its prefill "
                         f"({request.num_computed_tokens} computed, {request.num_output_tokens} sampled)")
    cache = core.runner.kv_cache
    tables = core.kv_cache_manager.get_block_ids(request_id)
    groups = core.kv_cache_manager.groups
    kv = []
    for layer in range(engine.loaded.config.num_hidden_layers):
        g = cache.layer_to_group[layer]
        first = n - transfer_tokens(n, groups[g].sliding_window)
        slots = _slots(tables[g], range(first, n), cache.block_size).to(cache.k_caches[layer].device)
        k_cache, v_cache = cache.k_caches[layer], cache.v_caches[layer]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        kv.append((flat_k.index_select(0, slots).cpu(), flat_v.index_select(0, slots).cpu()))
    return n, kv


def import_prefilled_request(engine: PagedLLMEngine, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams, first_token_id: int,
                             kv: Sequence[tuple[torch.Tensor, torch.Tensor]], first_positions: Sequence[int],
                             *, arrival_time: float | None = None) -> RequestOutput:
    """Continue a request prefilled elsewhere; returns the output carrying its first token.

    Args:
        prompt_token_ids: the N prompt tokens the KV was computed for.
        params: the request's sampling parameters (validated here).
        first_token_id: the token the prefill sampled.
        kv: per layer ``(K, V)`` ``[n_layer, num_kv_heads, head_dim]`` for positions
            ``first_positions[layer] .. N-1`` (a :class:`~inference_worker.kv_transfer.wire.KVPayload`'s
            ``layers``).

    If the first token already ends the request (stop/EOS token, ``max_tokens == 1``, a stop string)
    no block is allocated and the returned output is finished.

    Raises:
        ValueError: invalid params, a duplicate id, KV whose layer count, positions or shapes do not
            match a prefill of ``len(prompt_token_ids)`` tokens on this model.
        NoCapacity: no free seat (``max_num_seqs``) or not enough free blocks now; nothing was changed.
    """
    core, scheduler = engine.core, engine.core.scheduler
    n = len(prompt_token_ids)
    layout = kv_layout(engine)
    if len(kv) != layout.num_layers or len(first_positions) != layout.num_layers:
        raise ValueError(f"KV for {len(kv)} layers, the model has {layout.num_layers}")
    for layer, ((k, v), first, w) in enumerate(zip(kv, first_positions, layout.layer_windows, strict=True)):
        rows = transfer_tokens(n, w)
        shape = (rows, layout.num_kv_heads, layout.head_dim)
        if first != n - rows or tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise ValueError(f"layer {layer}: KV {tuple(k.shape)} from position {first} does not fit a prefill of "
                             f"{n} tokens (expected {shape} from {n - rows})")
    engine.add_request(request_id, list(prompt_token_ids), params, arrival_time=arrival_time)
    seq = engine._seqs[request_id]
    request = scheduler.requests[request_id]
    request.output_token_ids.append(int(first_token_id))
    seq.output_token_ids.append(int(first_token_id))
    seq.new_token_ids = [int(first_token_id)]
    seq.new_text = seq.detokenizer.push([int(first_token_id)]) if seq.detokenizer else ""
    seq.metrics.first_token_time = time.monotonic()
    finish = None
    if first_token_id in request.stop_token_ids:
        finish = ("stop", first_token_id if first_token_id in seq.params.stop_token_ids else None)
    elif seq.detokenizer is not None and seq.detokenizer.stopped:
        finish = ("stop", seq.detokenizer.stop_string)
    elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= scheduler.max_model_len:
        finish = ("length", None)
    if finish is not None:
        scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)
        engine._finish(seq, *finish)
        seq.text += seq.new_text
        del engine._seqs[request_id]
        return engine._output(seq)
    if scheduler.num_running >= scheduler.max_num_seqs or (
            core.kv_cache_manager.allocate_slots(request_id, n, 0) is None):
        _undo(engine, request_id)
        raise NoCapacity(f"no room to import {request_id!r} now ({scheduler.num_running} running, free blocks "
                         f"{core.kv_cache_manager.get_num_free_blocks()})")
    tables = core.kv_cache_manager.get_block_ids(request_id)
    cache = core.runner.kv_cache
    for layer, ((k, v), first) in enumerate(zip(kv, first_positions, strict=True)):
        g = cache.layer_to_group[layer]
        slots = _slots(tables[g], range(first, n), cache.block_size).to(cache.k_caches[layer].device)
        write_kv_to_cache(k.to(cache.k_caches[layer].device), v.to(cache.v_caches[layer].device),
                          cache.k_caches[layer], cache.v_caches[layer], slots)
    _move_to_running(scheduler, request, n)
    core.runner.requests[request_id] = CachedRequestState(
        request_id=request_id, token_ids=request.all_token_ids, num_prompt_tokens=n,
        sampling_params=request.sampling_params, block_ids=[list(t) for t in tables], num_computed_tokens=n,
        output_token_ids=[int(first_token_id)])
    seq.text += seq.new_text
    return engine._output(seq)


def _move_to_running(scheduler, request: Request, num_computed_tokens: int) -> None:
    scheduler.waiting.remove(request)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_computed_tokens
    scheduler._insert_sorted(scheduler.running, request)


def _undo(engine: PagedLLMEngine, request_id: str) -> None:
    """Forget a request added by the import (its blocks, if any, are freed)."""
    engine.core.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
    engine._seqs.pop(request_id, None)

