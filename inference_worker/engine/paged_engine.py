"""Paged engine: scheduler + KV cache manager + model runner, and the engine API on top of them.

``PagedEngineCore`` is the loop under the public engine API: ``add_request`` queues token ids,
``step`` schedules one batch (continuous batching, chunked prefill, preemption), runs it on
the model runner and returns each request's new tokens and finish reason. The KV cache is
sized at construction from ``kv_cache_memory`` and reported (log line + ``kv_cache_report``).
Prefix caching is on by default (``enable_prefix_caching``; hit rule in ``block_hash``). KV from
or to outside the batch goes through the engine's KV connector (``kv_handoff.PDConnector``).
:class:`~inference_worker.engine.llm_engine.PagedLLMEngine` puts the engine API on this core.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch

from inference_worker.engine.block_hash import prefix_root
from inference_worker.engine.kv_cache_manager import HybridKVCacheManager
from inference_worker.engine.kv_cache_sizing import plan_kv_cache, resolve_kv_cache_bytes
from inference_worker.engine.kv_events import KVEvent
from inference_worker.engine.kv_handoff import connector_for
from inference_worker.engine.kv_tiers import KVTierOptions, TieredConnector, tier_windows
from inference_worker.engine.model_runner import ModelRunner, PagedKVCache, SampleFn, greedy_sampler
from inference_worker.engine.request import Request, RequestStatus
from inference_worker.engine.sched_output import RequestUpdate
from inference_worker.engine.scheduler import Scheduler

DEFAULT_CPU_KV_CACHE_MEMORY = "1GiB"


class PagedEngineCore:
    """Continuous-batching generation over a paged, hybrid-attention KV cache.

    Args:
        model: a loaded ``CausalLM`` (its parameters' dtype and device are used for the cache).
        kv_cache_memory: bytes, a size string (``"1GiB"``) or a fraction of free accelerator
            memory (CPU: of available RAM); see ``kv_cache_sizing``. None: 0.9 of free memory on
            CUDA, ``DEFAULT_CPU_KV_CACHE_MEMORY`` on CPU (a fraction of RAM would take gigabytes
            per worker process on a shared host).
        block_size: tokens per KV block.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens per step (prefill chunks + decodes).
        max_model_len: most tokens per request (default: the model's ``max_position_embeddings``).
        sampler: ``(logits [n, vocab], states) -> token ids``.
        attention: ``"paged"`` (fast path) or ``"reference"`` (pure-torch gather + reference kernel).
        enable_prefix_caching: reuse the KV of earlier requests' identical prefixes (default on).
        weights_sha256: salts the block digests (KV is only valid for its weights); None: a random
            salt, so digests are valid in this engine only (the worker always passes the hash).
        kv_tiers: host/disk/shared KV tiers (:mod:`~inference_worker.engine.kv_tiers`); None: none.
            Needs prefix caching and ``weights_sha256``.

    Raises:
        ValueError: on an invalid ``kv_cache_memory``, a budget too small for one block per
            group, or an unknown ``attention``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        kv_cache_memory: int | float | str | None = None,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        sampler: SampleFn = greedy_sampler,
        attention: str = "paged",
        enable_prefix_caching: bool = True,
        weights_sha256: str | None = None,
        kv_tiers: KVTierOptions | None = None,
    ) -> None:
        if attention not in ("paged", "reference"):
            raise ValueError(f"attention must be 'paged' or 'reference', got {attention!r}")
        config = model.config
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        free_accelerator_bytes = None
        if self.device.type == "cuda":
            free_accelerator_bytes = torch.cuda.mem_get_info(self.device)[0]
        if kv_cache_memory is None:
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY if free_accelerator_bytes is None else 0.9
        budget = resolve_kv_cache_bytes(kv_cache_memory, free_accelerator_bytes=free_accelerator_bytes)
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.kv_plan = plan_kv_cache(
            config,
            budget_bytes=budget,
            block_size=block_size,
            dtype_bytes=param.element_size(),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
        )
        kv_dtype = str(self.dtype).removeprefix("torch.")
        self.kv_cache_manager = HybridKVCacheManager(
            self.kv_plan.group_specs(), enable_prefix_caching=enable_prefix_caching,
            prefix_root=prefix_root(weights_sha256 or secrets.token_hex(32), kv_dtype, block_size))
        kv_cache = PagedKVCache(
            self.kv_plan,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
            use_reference=attention == "reference",
        )
        if kv_tiers is not None and kv_tiers.stores:
            if weights_sha256 is None:
                raise ValueError("KV tiers need the weights sha256 (entries are only valid for their weights)")
            self.connector = TieredConnector(kv_cache, tier_windows(config), kv_manager=self.kv_cache_manager,
                                             options=kv_tiers, weights_sha256=weights_sha256, kv_dtype=kv_dtype)
        else:
            self.connector = connector_for(kv_cache, config)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            connector=self.connector,
        )
        self.runner = ModelRunner(model, kv_cache, sampler=sampler, device=self.device, connector=self.connector)
        self.num_steps = 0
        self.num_preemptions = 0
        self.admission_listener: Callable[[dict[str, int]], None] | None = None

    @property
    def kv_cache_report(self) -> dict[str, Any]:
        """Start-up report: budget, block size, blocks/tokens/bytes per attention type."""
        return self.kv_plan.as_dict()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int,
        stop_token_ids: tuple[int, ...] | list[int] = (),
        sampling_params: Any = None,
        arrival_time: float | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> Request:
        """Queue a request; returns its scheduler-side state.

        ``output_token_ids``: tokens generated elsewhere (a PD import's first token).

        Raises:
            ValueError: from ``Request``/``Scheduler.add_request`` (empty prompt, duplicate id,
                prompt too long, request larger than the KV cache).
        """
        request = Request(request_id, prompt_token_ids, max_tokens, stop_token_ids, sampling_params, arrival_time,
                          output_token_ids=list(output_token_ids))
        self.scheduler.add_request(request)
        return request

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests now; their KV blocks are freed at once."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str]) -> None:
        """Finish requests stopped outside the scheduler (e.g. by a stop string) with reason ``"stop"``."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestUpdate]:
        """Schedule, run and sample one batch; returns the per-request updates of this step."""
        scheduler_output = self.scheduler.schedule()
        self.num_preemptions += len(scheduler_output.preempted_req_ids)
        if scheduler_output.num_cached_tokens and self.admission_listener is not None:
            self.admission_listener(dict(scheduler_output.num_cached_tokens))  # before the first token is computed
        runner_output = self.runner.execute_model(scheduler_output)
        if scheduler_output.is_empty and self.scheduler.loading:  # only parked requests: wait for a load
            self.connector.wait_for_any_load(0.01)
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (blocks in use keep their KV), and this worker's KV tier entries
        (see ``TieredConnector.reset``); returns how many device blocks were forgotten."""
        if isinstance(self.connector, TieredConnector):
            self.connector.reset()
        return self.kv_cache_manager.reset_prefix_cache()

    def kv_events_snapshot(self) -> list[KVEvent]:
        """Every tier now as events: ``AllCleared``, the device blocks, then the tiers' blocks."""
        events = self.kv_cache_manager.snapshot_events()
        if isinstance(self.connector, TieredConnector):
            events += self.connector.snapshot_events()
        return events

    def prefix_cache_stats(self) -> dict[str, Any]:
        """Counters since start: ``query_tokens``, ``hit_tokens``; per group ``evictions`` and ``cached_blocks``;
        ``tiers``: per KV tier (``TieredConnector.tier_stats``) when tiers are configured."""
        kv = self.kv_cache_manager
        names = [group.attention_type for group in kv.groups]
        stats = {"query_tokens": kv.num_query_tokens, "hit_tokens": kv.num_hit_tokens,
                 "evictions": dict(zip(names, kv.get_num_evictions(), strict=True)),
                 "cached_blocks": dict(zip(names, kv.get_num_cached_blocks(), strict=True))}
        if isinstance(self.connector, TieredConnector):
            stats["tiers"] = self.connector.tier_stats()
        return stats

    def last_logits(self, request_id: str) -> torch.Tensor | None:
        """Logits ``[vocab]`` (float32) the request's last token was sampled from, if sampled in the last step."""
        return self.runner.last_logits.get(request_id)
