"""The engine API (``add_request`` / ``step`` / ``abort_request`` / ``generate``) on the paged engine core.

:class:`PagedLLMEngine` (exported as ``LLMEngine``, the engine the worker serves with) puts text
prompts, sampling parameters, stop strings and ``RequestOutput`` on
:class:`~inference_worker.engine.paged_engine.PagedEngineCore` (continuous batching, chunked prefill,
preemption, prefix caching over a paged hybrid-attention KV cache), plus the PD hand-off through the
engine's KV connector (``kv_export`` / :meth:`PagedLLMEngine.pop_exported_kv`,
:meth:`PagedLLMEngine.add_prefilled_request`), the prefix-cache reset, KV events and statistics. The
contiguous-cache engine it was checked against lives in :mod:`inference_worker.reference`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from inference_worker.engine.kv_events import KVEvent
from inference_worker.engine.kv_handoff import KVList
from inference_worker.engine.model_runner import SampleFn
from inference_worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inference_worker.engine.paged_engine import PagedEngineCore
from inference_worker.engine.sampler import Sampler as TokenSampler
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.model.loader import LoadedModel, load_model
from inference_worker.tokenization import IncrementalDetokenizer


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
    num_cached_tokens: int | None = None
    num_remote_cached_tokens: int = 0
    """PD import: prompt tokens the prefill worker took from its prefix cache (not computed for this request)."""


def _sample_with(sampler: TokenSampler) -> SampleFn:
    """Adapt the engine's ``Sampler`` (params + seeded generator per request) to the runner."""

    def sample(logits: torch.Tensor, states: list[Any]) -> list[int]:
        contexts = [state.sampling_params for state in states]
        return sampler.sample(logits, [c.params for c in contexts], [c.generator for c in contexts])

    return sample


class PagedLLMEngine:
    """The engine API (``add_request`` / ``step`` / ``abort_request`` / ``generate``) on the paged core.

    Same public API and stop rules as the contiguous reference engine: stop token ids, EOS (unless
    ``ignore_eos``), stop strings (text cut before the string), ``max_tokens``, ``max_model_len``.
    Token-based stops and lengths are applied by the scheduler (which frees the blocks at once);
    stop strings by the detokenizer here, which then finishes the request in the scheduler.

    Args:
        loaded: a ``LoadedModel`` (with tokenizer).
        max_num_seqs, max_model_len: as ``PagedEngineCore``.
        kernel: ``"sdpa"`` (paged fast path) or ``"reference"`` (gather + pure-torch reference).
        kv_cache_memory, block_size, max_num_batched_tokens, enable_prefix_caching: as ``PagedEngineCore``.
        weights_sha256: salt of the block digests (default: ``loaded.sha256``).
        kv_tiers: host/disk/shared KV tiers (``kv_tiers.KVTierOptions``); None: none.
    """

    def __init__(self, loaded: LoadedModel, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 kernel: str = "sdpa", kv_cache_memory: int | float | str | None = None, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 weights_sha256: str | None = None, kv_tiers: Any = None) -> None:
        if kernel not in ("sdpa", "reference"):
            raise ValueError(f"unknown attention kernel {kernel!r}; choose 'sdpa' or 'reference'")
        self.loaded = loaded
        self.sampler = TokenSampler()
        self.core = PagedEngineCore(
            loaded.model, kv_cache_memory=kv_cache_memory, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            sampler=_sample_with(self.sampler), attention="paged" if kernel == "sdpa" else "reference",
            enable_prefix_caching=enable_prefix_caching, weights_sha256=weights_sha256 or loaded.sha256,
            kv_tiers=kv_tiers,
        )
        self.max_model_len = self.core.max_model_len
        self._seqs: dict[str, _Sequence] = {}
        self._aborted: list[_Sequence] = []
        self._admission_listener: Callable[[dict[str, int]], None] | None = None
        self.core.admission_listener = self._on_admitted

    def kv_capacity_error(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of ``num_prompt_tokens`` + ``max_tokens`` could never fit in the KV cache, or None.

        The check :meth:`add_request` makes, for callers that decide before queueing (the server answers
        400); reads only the cache's fixed geometry, so any thread may call it.
        """
        return self.core.scheduler.capacity_error(num_prompt_tokens, max_tokens)

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + output tokens one request can hold: ``max_model_len`` capped by the KV cache."""
        return self.core.scheduler.max_request_tokens()

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
                    *, arrival_time: float | None = None, kv_export: bool = False) -> None:
        """Queue a request; ``prompt`` is text (tokenized, BOS included) or token ids.

        ``kv_export``: save the KV of the prompt when the request finishes (prefill role; take it with
        :meth:`pop_exported_kv`).

        Raises:
            ValueError: duplicate id, empty prompt, prompt too long for ``max_model_len`` or the KV
                cache, token ids outside the vocabulary, or invalid ``params``.
        """
        self._add(request_id, prompt, params, arrival_time)
        if kv_export:
            self.core.connector.expect_export(request_id)

    def _add(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None,
             arrival_time: float | None, first_token_id: int | None = None) -> _Sequence:
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
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.loaded.tokenizer else None
        seq = _Sequence(request_id, text, list(token_ids), params, detok, RequestMetrics(arrival))
        if first_token_id is not None:  # prefilled elsewhere: the first token may already end the request
            seq.num_cached_tokens = 0
            seq.output_token_ids, seq.new_token_ids = [first_token_id], [first_token_id]
            seq.new_text = detok.push([first_token_id]) if detok else ""
            seq.metrics.first_token_time = time.monotonic()
            if first_token_id in stop_ids:
                self._finish(seq, "stop", first_token_id if first_token_id in params.stop_token_ids else None)
            elif detok is not None and detok.stopped:
                self._finish(seq, "stop", detok.stop_string)
            elif params.max_tokens <= 1 or len(token_ids) + 1 >= self.max_model_len:
                self._finish(seq, "length")
            seq.text += seq.new_text
            if seq.finish_reason is not None:
                return seq
        self.core.add_request(request_id, token_ids, max_tokens=params.max_tokens, stop_token_ids=stop_ids,
                              sampling_params=_Sampling(params, generator), arrival_time=arrival,
                              output_token_ids=[] if first_token_id is None else [first_token_id])
        self._seqs[request_id] = seq
        return seq

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                              first_token_id: int, kv: KVList, first_positions: Sequence[int], *,
                              arrival_time: float | None = None, num_cached_tokens: int = 0) -> RequestOutput:
        """Continue a request prefilled elsewhere (PD decode role); returns the output carrying its first token.

        Args:
            prompt_token_ids: the N prompt tokens the KV was computed for.
            first_token_id: the token the prefill sampled.
            kv: per layer ``(K, V)`` ``[n_layer, num_kv_heads, head_dim]`` for positions
                ``first_positions[layer] .. N-1`` (a ``KVPayload``'s ``layers``), on any device.
            num_cached_tokens: prompt tokens the prefill worker reused from its prefix cache, in
                ``[0, N)``; the request's ``num_cached_tokens`` (what clients see as ``cached_tokens``)
                counts the prompt tokens not computed for it, wherever the prefill ran.

        The request waits for a seat and blocks like any other (FCFS); at admission the KV is copied
        into its blocks by the connector and the next step decodes the first token. If the first
        token already ends the request (stop/EOS token, ``max_tokens == 1``, a stop string) nothing
        is queued and the returned output is finished.

        Raises:
            ValueError: invalid params, a duplicate id, KV whose layer count, positions or shapes do
                not match a prefill of ``len(prompt_token_ids)`` tokens on this model, or
                ``num_cached_tokens`` outside ``[0, N)`` (the last prompt token is always computed).
        """
        if not 0 <= num_cached_tokens < len(prompt_token_ids):
            raise ValueError(f"num_cached_tokens must be in [0, {len(prompt_token_ids)}) for a prompt of "
                             f"{len(prompt_token_ids)} tokens, got {num_cached_tokens}")
        config = self.loaded.config
        self.core.connector.validate_import(len(prompt_token_ids), kv, first_positions, config.num_key_value_heads,
                                            config.head_dim)
        seq = self._add(request_id, list(prompt_token_ids), params, arrival_time, int(first_token_id))
        seq.num_cached_tokens = seq.num_remote_cached_tokens = num_cached_tokens
        if seq.finish_reason is None:
            self.core.connector.expect_import(request_id, len(prompt_token_ids), kv, first_positions)
        output = self._output(seq)
        seq.new_token_ids, seq.new_text = [], ""
        return output

    def pop_exported_kv(self, request_id: str) -> tuple[int, KVList] | None:
        """The KV saved for a ``kv_export`` request when it finished: ``(N, [(K, V)] per layer)`` on CPU, once.

        Full layers carry ``N`` rows, sliding layers ``min(N, W-1)`` (the rows a decode of token N reads).
        None when nothing was saved (the request was aborted, or is unknown).
        """
        return self.core.connector.pop_exported(request_id)

    def set_admission_listener(self, listener: Callable[[dict[str, int]], None] | None) -> None:
        """Call ``listener({request_id: num_cached_tokens})`` when requests are first admitted, before their
        first token is computed (from inside :meth:`step`, on the engine thread)."""
        self._admission_listener = listener

    def _on_admitted(self, num_cached_tokens: dict[str, int]) -> None:
        reported = {}
        for request_id, hit in num_cached_tokens.items():
            seq = self._seqs.get(request_id)
            if seq is not None:  # a PD import adds what its prefill worker did not compute
                seq.num_cached_tokens = hit = hit + seq.num_remote_cached_tokens
            reported[request_id] = hit
        if self._admission_listener is not None:
            self._admission_listener(reported)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (see ``PagedEngineCore.reset_prefix_cache``); returns how many."""
        return self.core.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, Any]:
        """See ``PagedEngineCore.prefix_cache_stats``."""
        return self.core.prefix_cache_stats()

    def take_kv_events(self) -> list[KVEvent]:
        """KV cache events since the previous call, oldest first (stored, removed, cleared)."""
        return self.core.kv_cache_manager.take_events()

    def kv_events_snapshot(self) -> list[KVEvent]:
        """The prefix cache as it is now: ``AllCleared`` then a ``BlockStored`` per cached block."""
        return self.core.kv_events_snapshot()

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
                             seq.finish_reason is not None, seq.metrics, seq.num_cached_tokens)


LLMEngine = PagedLLMEngine
"""The engine the worker serves with."""
