"""Paged engine: scheduler + KV cache manager + model runner, and the engine API on top of them.

``PagedEngineCore`` is the loop under the public engine API: ``add_request`` queues token ids,
``step`` schedules one batch (continuous batching, chunked prefill, preemption), runs it on
the model runner and returns each request's new tokens and finish reason. The KV cache is
sized at construction from ``kv_cache_memory`` and reported (log line + ``kv_cache_report``).
``PagedLLMEngine`` puts the engine API of ``llm_engine`` (text prompts, sampling parameters,
stop strings, ``RequestOutput``) on this core.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from inference_worker.engine.kv_cache_manager import HybridKVCacheManager
from inference_worker.engine.kv_cache_sizing import plan_kv_cache, resolve_kv_cache_bytes
from inference_worker.engine.model_runner import ModelRunner, PagedKVCache, SampleFn, greedy_sampler
from inference_worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inference_worker.engine.request import Request, RequestStatus
from inference_worker.engine.sampler import Sampler as TokenSampler
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.engine.sched_output import RequestUpdate
from inference_worker.engine.scheduler import Scheduler
from inference_worker.model.loader import LoadedModel, load_model
from inference_worker.tokenization import IncrementalDetokenizer

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


@dataclass
class _Sampling:
    """What the runner's sampler needs per request: the params and the request's own generator."""

    params: SamplingParams
    generator: torch.Generator | None


@dataclass
class _Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None


def _sample_with(sampler: TokenSampler) -> SampleFn:
    """Adapt the engine's ``Sampler`` (params + seeded generator per request) to the runner."""

    def sample(logits: torch.Tensor, states: list[Any]) -> list[int]:
        contexts = [state.sampling_params for state in states]
        return sampler.sample(logits, [c.params for c in contexts], [c.generator for c in contexts])

    return sample


class PagedLLMEngine:
    """The engine API (``add_request`` / ``step`` / ``abort_request`` / ``generate``) on the paged core.

    Same public API and stop rules as the contiguous ``LLMEngine``: stop token ids, EOS (unless
    ``ignore_eos``), stop strings (text cut before the string), ``max_tokens``, ``max_model_len``.
    Token-based stops and lengths are applied by the scheduler (which frees the blocks at once);
    stop strings by the detokenizer here, which then finishes the request in the scheduler.

    Args:
        loaded: a ``LoadedModel`` (with tokenizer).
        max_num_seqs, max_model_len: as ``PagedEngineCore``.
        kernel: ``"sdpa"`` (paged fast path) or ``"reference"`` (gather + pure-torch reference).
        kv_cache_memory, block_size, max_num_batched_tokens: as ``PagedEngineCore``.
    """

    def __init__(self, loaded: LoadedModel, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 kernel: str = "sdpa", kv_cache_memory: int | float | str | None = None, block_size: int = 16,
                 max_num_batched_tokens: int = 2048) -> None:
        if kernel not in ("sdpa", "reference"):
            raise ValueError(f"unknown attention kernel {kernel!r}; choose 'sdpa' or 'reference'")
        self.loaded = loaded
        self.sampler = TokenSampler()
        self.core = PagedEngineCore(
            loaded.model, kv_cache_memory=kv_cache_memory, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            sampler=_sample_with(self.sampler), attention="paged" if kernel == "sdpa" else "reference",
        )
        self.max_model_len = self.core.max_model_len
        self._seqs: dict[str, _Sequence] = {}
        self._aborted: list[_Sequence] = []

    @classmethod
    def from_model(cls, name_or_path: str, *, dtype: str | None = None, device: str = "cpu",
                   sha256: str | None = None, **engine_kwargs: Any) -> PagedLLMEngine:
        """Load a model (see ``load_model``) and build an engine."""
        return cls(load_model(name_or_path, dtype=dtype, device=device, sha256=sha256), **engine_kwargs)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's ``tokenizers.Tokenizer``."""
        if self.loaded.tokenizer is None:
            raise RuntimeError("this model was loaded without a tokenizer")
        return self.loaded.tokenizer

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (the fullest attention-type group), 0..1."""
        return self.core.kv_cache_manager.get_usage()

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted)."""
        return self.core.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return self.core.scheduler.num_running

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None) -> None:
        """Queue a request; ``prompt`` is text (tokenized, BOS included) or token ids.

        Raises:
            ValueError: duplicate id, empty prompt, prompt too long for ``max_model_len`` or the KV
                cache, token ids outside the vocabulary, or invalid ``params``.
        """
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = (params or SamplingParams()).validate()
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room for output under max_model_len {self.max_model_len}"
            )
        vocab = self.loaded.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.loaded.eos_token_ids))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self.core.add_request(request_id, token_ids, max_tokens=params.max_tokens, stop_token_ids=stop_ids,
                              sampling_params=_Sampling(params, generator), arrival_time=arrival)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.loaded.tokenizer else None
        self._seqs[request_id] = _Sequence(request_id, text, list(token_ids), params, detok, RequestMetrics(arrival))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; the next ``step`` reports it with ``"abort"``."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.core.abort_requests([request_id])
        seq.finish_reason, seq.new_token_ids, seq.new_text = "abort", [], ""
        seq.metrics.finished_time = time.monotonic()
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an abort not yet reported."""
        return bool(self._seqs or self._aborted)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output per request that produced tokens or finished."""
        reported, self._aborted = self._aborted, []
        stepped = []
        updates = self.core.step() if self.core.has_unfinished_requests() else []
        now = time.monotonic()
        for update in updates:
            seq = self._seqs[update.request_id]
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            seq.output_token_ids += update.new_token_ids
            seq.new_token_ids = list(update.new_token_ids)
            seq.new_text = seq.detokenizer.push(update.new_token_ids) if seq.detokenizer else ""
            last = update.new_token_ids[-1]
            if update.finish_reason == "stop":
                self._finish(seq, "stop", last if last in seq.params.stop_token_ids else None)
            elif seq.detokenizer is not None and seq.detokenizer.stopped:
                self.core.finish_requests([seq.request_id])
                self._finish(seq, "stop", seq.detokenizer.stop_string)
            elif update.finish_reason == "length":
                self._finish(seq, "length")
            seq.text += seq.new_text
            stepped.append(seq)
        outputs = [self._output(seq) for seq in reported + stepped]
        for seq in stepped:
            if seq.finish_reason is not None:
                del self._seqs[seq.request_id]
        return outputs

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; returns the final outputs in prompt order.

        Raises:
            ValueError: as ``add_request``, or a list of params of the wrong length.
        """
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, params in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, SamplingParams(**vars(params)))
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def _finish(self, seq: _Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finished_time = time.monotonic()
        if seq.detokenizer is not None and not seq.detokenizer.stopped:
            seq.new_text += seq.detokenizer.finish()

    def _output(self, seq: _Sequence) -> RequestOutput:
        completion = CompletionOutput(0, seq.text, list(seq.output_token_ids), list(seq.new_token_ids),
                                      seq.new_text, seq.finish_reason, seq.stop_reason)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion],
                             seq.finish_reason is not None, seq.metrics)
