"""Paged engine core: scheduler + KV cache manager + model runner, stepped one batch at a time.

``PagedEngineCore`` is the loop under the public engine API: ``add_request`` queues token ids,
``step`` schedules one batch (continuous batching, chunked prefill, preemption), runs it on
the model runner and returns each request's new tokens and finish reason. The KV cache is
sized at construction from ``kv_cache_memory`` and reported (log line + ``kv_cache_report``).
"""

from __future__ import annotations

from typing import Any

import torch

from inference_worker.engine.kv_cache_manager import HybridKVCacheManager
from inference_worker.engine.kv_cache_sizing import plan_kv_cache, resolve_kv_cache_bytes
from inference_worker.engine.model_runner import ModelRunner, PagedKVCache, Sampler, greedy_sampler
from inference_worker.engine.request import Request, RequestStatus
from inference_worker.engine.sched_output import RequestUpdate
from inference_worker.engine.scheduler import Scheduler


class PagedEngineCore:
    """Continuous-batching generation over a paged, hybrid-attention KV cache.

    Args:
        model: a loaded ``CausalLM`` (its parameters' dtype and device are used for the cache).
        kv_cache_memory: bytes, a size string (``"1GiB"``) or a fraction of free accelerator
            memory (CPU: of available RAM); see ``kv_cache_sizing``.
        block_size: tokens per KV block.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens per step (prefill chunks + decodes).
        max_model_len: most tokens per request (default: the model's ``max_position_embeddings``).
        sampler: ``(logits [n, vocab], states) -> token ids``.
        attention: ``"paged"`` (fast path) or ``"reference"`` (pure-torch gather + reference kernel).

    Raises:
        ValueError: on an invalid ``kv_cache_memory``, a budget too small for one block per
            group, or an unknown ``attention``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        kv_cache_memory: int | float | str = 0.2,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        sampler: Sampler = greedy_sampler,
        attention: str = "paged",
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
        budget = resolve_kv_cache_bytes(kv_cache_memory, free_accelerator_bytes=free_accelerator_bytes)
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.kv_plan = plan_kv_cache(
            config,
            budget_bytes=budget,
            block_size=block_size,
            dtype_bytes=param.element_size(),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.kv_cache_manager = HybridKVCacheManager(self.kv_plan.group_specs())
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        kv_cache = PagedKVCache(
            self.kv_plan,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
            use_reference=attention == "reference",
        )
        self.runner = ModelRunner(model, kv_cache, sampler=sampler, device=self.device)
        self.num_steps = 0
        self.num_preemptions = 0

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
    ) -> Request:
        """Queue a request; returns its scheduler-side state.

        Raises:
            ValueError: from ``Request``/``Scheduler.add_request`` (empty prompt, duplicate id,
                prompt too long, request larger than the KV cache).
        """
        request = Request(request_id, prompt_token_ids, max_tokens, stop_token_ids, sampling_params, arrival_time)
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
        runner_output = self.runner.execute_model(scheduler_output)
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def last_logits(self, request_id: str) -> torch.Tensor | None:
        """Logits ``[vocab]`` (float32) the request's last token was sampled from, if sampled in the last step."""
        return self.runner.last_logits.get(request_id)
