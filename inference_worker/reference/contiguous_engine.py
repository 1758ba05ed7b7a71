"""ContiguousLLMEngine: the original simple engine, a test reference with the engine API of ``LLMEngine``.

It runs over :class:`~inference_worker.reference.contiguous_runner.ContiguousModelRunner` (one
contiguous KV row per sequence, at most ``max_num_seqs`` running) with the same public API as the
paged engine (:class:`~inference_worker.engine.llm_engine.LLMEngine`). Each of its
:meth:`ContiguousLLMEngine.step` calls prefills newly admitted requests (FIFO, while slots
are free) and runs one decode step for the others, then samples, detokenizes incrementally and applies the
stop rules: stop token ids, EOS (unless ``ignore_eos``), stop strings (text cut before the string),
``max_tokens`` and ``max_model_len``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from inference_worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inference_worker.engine.sampler import Sampler
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.model.loader import LoadedModel, load_model
from inference_worker.reference.contiguous_runner import ContiguousModelRunner
from inference_worker.tokenization import IncrementalDetokenizer


@dataclass
class _Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    metrics: RequestMetrics
    slot: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class ContiguousLLMEngine:
    """Continuous batching over a contiguous KV cache.

    Args:
        loaded: a :class:`~inference_worker.model.loader.LoadedModel` (with tokenizer).
        max_num_seqs: sequences running at once (others wait, FIFO).
        max_model_len: longest prompt + output in tokens (default: the model's context length).
        kernel: attention kernel, ``"sdpa"`` or ``"reference"``.
    """

    def __init__(self, loaded: LoadedModel, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 kernel: str = "sdpa") -> None:
        self.loaded = loaded
        self.runner = ContiguousModelRunner(loaded.model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                            kernel=kernel)
        self.max_model_len = self.runner.max_model_len
        self.sampler = Sampler()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._aborted: list[_Sequence] = []
        self._ids: set[str] = set()

    @classmethod
    def from_model(cls, name_or_path: str, *, dtype: str | None = None, device: str = "cpu",
                   sha256: str | None = None, **engine_kwargs: object) -> ContiguousLLMEngine:
        """Load a model (built-in name, HF directory or ``.gguf``; see ``load_model``) and build an engine."""
        return cls(load_model(name_or_path, dtype=dtype, device=device, sha256=sha256), **engine_kwargs)  # type: ignore[arg-type]

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's ``tokenizers.Tokenizer``."""
        if self.loaded.tokenizer is None:
            raise RuntimeError("this model was loaded without a tokenizer")
        return self.loaded.tokenizer

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None) -> None:
        """Queue a request. ``prompt`` is text (tokenized with the model's tokenizer, BOS included) or token ids.

        Raises:
            ValueError: duplicate ``request_id``, empty prompt, a prompt that leaves no room under
                ``max_model_len``, token ids outside the vocabulary, or invalid ``params``.
        """
        if request_id in self._ids:
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
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.loaded.tokenizer else None
        seq = _Sequence(request_id, text, list(token_ids), params, detok, generator,  # type: ignore[arg-type]
                        RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()))
        self._ids.add(request_id)
        self._waiting.append(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; the next :meth:`step` reports it with finish_reason ``"abort"``. False if unknown/finished."""
        for queue in (self._waiting, self._running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    self._aborted.append(seq)
                    return True
        return False

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an abort not yet reported."""
        return bool(self._waiting or self._running or self._aborted)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a KV slot."""
        return len(self._running)

    def step(self) -> list[RequestOutput]:
        """Prefill admitted requests, decode running ones, sample, apply stop rules.

        Returns one :class:`RequestOutput` per request that produced tokens or finished in this step.
        """
        reported = self._aborted
        self._aborted = []
        decoding = list(self._running)
        admitted: list[_Sequence] = []
        while self._waiting and self.runner.num_free_slots:
            seq = self._waiting.popleft()
            seq.slot = self.runner.allocate_slot()
            admitted.append(seq)
        for seq in admitted:
            logits = self.runner.prefill(seq.slot, seq.prompt_token_ids)  # type: ignore[arg-type]
            self._append(seq, self.sampler.sample(logits[None], [seq.params], [seq.generator])[0])
        if decoding:
            logits = self.runner.decode([s.slot for s in decoding], [s.output_token_ids[-1] for s in decoding],  # type: ignore[misc]
                                        [s.num_tokens - 1 for s in decoding])
            tokens = self.sampler.sample(logits, [s.params for s in decoding], [s.generator for s in decoding])
            for seq, token in zip(decoding, tokens, strict=True):
                self._append(seq, token)
        stepped = admitted + decoding
        self._running = [s for s in decoding + admitted if s.finish_reason is None]
        outputs = [self._output(s) for s in reported + stepped]
        for seq in stepped:
            if seq.finish_reason is not None:
                self._release(seq)
        return outputs

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; returns the final outputs in prompt order.

        Raises:
            ValueError: as :meth:`add_request`, or a list of params of the wrong length.
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

    # ---------------------------------------------------------------- internals
    def _append(self, seq: _Sequence, token: int) -> None:
        now = time.monotonic()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.output_token_ids.append(token)
        seq.new_token_ids = [token]
        params = seq.params
        seq.new_text = seq.detokenizer.push([token]) if seq.detokenizer else ""
        if token in params.stop_token_ids:
            self._finish(seq, "stop", token)
        elif not params.ignore_eos and token in self.loaded.eos_token_ids:
            self._finish(seq, "stop")
        elif seq.detokenizer is not None and seq.detokenizer.stopped:
            self._finish(seq, "stop", seq.detokenizer.stop_string)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
        seq.text += seq.new_text

    def _finish(self, seq: _Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.metrics.finished_time = time.monotonic()
        if seq.detokenizer is not None and reason != "abort" and not seq.detokenizer.stopped:
            seq.new_text += seq.detokenizer.finish()
        if reason == "abort":
            seq.new_token_ids, seq.new_text = [], ""
            if seq.slot is not None:
                self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        if seq.slot is not None:
            self.runner.free_slot(seq.slot)
            seq.slot = None
        self._ids.discard(seq.request_id)

    def _output(self, seq: _Sequence) -> RequestOutput:
        completion = CompletionOutput(0, seq.text, list(seq.output_token_ids), list(seq.new_token_ids),
                                      seq.new_text, seq.finish_reason, seq.stop_reason)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion],
                             seq.finish_reason is not None, seq.metrics)

