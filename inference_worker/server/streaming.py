"""One API request's generation: its engine requests, detokenization, events and SSE framing.

An API request with P prompts and ``n`` choices becomes P*n engine requests
(``{id}-{index}``, choice ``index = prompt_index * n + i``) sharing one update queue.
:meth:`Generation.events` yields the engine's text deltas, which its incremental detokenizer
(:class:`~inference_worker.tokenization.IncrementalDetokenizer`) has already made safe to send: no
partial UTF-8 character, nothing that could still become a stop string, text cut right before a
stop string. A non-streamed response is exactly the join of the same deltas.

``completion_tokens`` counts every token the engine generated for the choice, including the
EOS/stop token or the token that completed a stop string (as vLLM counts them).
``prompt_tokens_details.cached_tokens`` counts, per prompt (prompts are counted once, as OpenAI
does), the prompt tokens its first choice reused from the prefix cache; the engine reports each
hit when it admits the sequence (:meth:`Generation.wait_admitted`), before its first token.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from inference_worker.metrics import WorkerMetrics
from inference_worker.server.engine_loop import EngineLoop, SeqUpdate


@dataclass(frozen=True)
class ChoiceEvent:
    """A piece of one choice's text; ``finish_reason`` is set on the choice's last event.

    ``token_ids``: the ids generated for the choice since its previous event (ids whose text the
    detokenizer still holds back ride with the next event; the last event carries the rest), so the
    events' ids joined are every id generated for the choice.
    """

    index: int
    text: str
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()


CLIENT_ERROR_CODES = ("context_length_exceeded", "invalid_prompt")
"""Error codes of a sequence the request itself made impossible (a prompt over a limit): a 400, not a 5xx."""


class GenerationError(Exception):
    """The engine failed or refused one of the request's sequences.

    ``code`` is the OpenAI error code (``engine_error``; ``kv_transfer_failed`` when a disaggregated prefill
    failed and recompute is off; one of :data:`CLIENT_ERROR_CODES` when the prefill worker refused the prompt
    and recompute is off). ``status``: 400 for a client error code, 502 for ``kv_transfer_failed``, else 500.
    """

    def __init__(self, message: str, code: str = "engine_error"):
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> int:
        return 400 if self.code in CLIENT_ERROR_CODES else 502 if self.code == "kv_transfer_failed" else 500


@dataclass
class _Choice:
    index: int
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    pending_token_ids: list[int] = field(default_factory=list)
    first_update_ns: int | None = None  # wall clock (ns) of the engine's first word on it: admitted or refused
    first_token_ns: int | None = None


@dataclass(eq=False)  # identity semantics: tracked in a set while in flight
class Generation:
    """Drives the engine requests of one API request.

    Args:
        engine_loop: the worker's :class:`EngineLoop`.
        request_id: the API request id (``cmpl-...`` / ``chatcmpl-...``).
        prompts: token ids per prompt.
        n: choices per prompt.
        make_params: ``choice_index -> engine SamplingParams`` (seeds differ per choice).
        metrics: the worker's metrics (TTFT, TPOT, e2e, token counters and request lengths per sequence).
        remote_prefill: decode role with a prefill endpoint: ``async (engine_loop, request_id, prompt,
            params, sampling, updates)`` that obtains the prefill from the prefill worker and submits
            the sequence (see :mod:`.pd`); None submits to the engine directly.
        sampling: the request's sampling options forwarded to the prefill worker.
        traffic: the request is the pool's traffic: its latencies and lengths go to the TTFT, TPOT, e2e and
            request-length histograms (False for a profiling sweep's request, header ``x-ferry-profiling``: the
            control plane's measurement is neither the clients' latency nor their workload; it still counts as a
            request and in the token counters, work the worker did).
        timeline: where the first choice's phases go (:mod:`inference_worker.tracing`): ``decode.queue``
            (submitted, or the KV arrived, to admitted), ``prefill`` (admitted to the first token; absent after a
            remote prefill) and ``decode`` (first token to the last, with token counts).
    """

    engine_loop: EngineLoop
    request_id: str
    prompts: list[list[int]]
    n: int
    make_params: Callable[[int], Any]
    metrics: WorkerMetrics | None = None
    arrival: float = field(default_factory=time.monotonic)
    remote_prefill: Callable[..., Any] | None = None
    sampling: dict = field(default_factory=dict)
    timeline: Any = None
    traffic: bool = True

    def __post_init__(self) -> None:
        self._submitted_ns = 0
        self._tasks: set[asyncio.Task] = set()
        self._choices: dict[str, _Choice] = {}
        self._updates: asyncio.Queue[SeqUpdate] = asyncio.Queue()
        self._early: collections.deque[SeqUpdate] = collections.deque()
        self._started = False

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the request (each prompt counted once, as OpenAI does)."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated over all choices so far."""
        return sum(c.num_output_tokens for c in self._choices.values())

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache: per prompt, its first choice's hit (0 until admitted)."""
        return sum(c.num_cached_tokens or 0 for c in self._choices.values() if c.index % self.n == 0)

    def usage(self) -> dict:
        """OpenAI ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    async def wait_admitted(self) -> None:
        """Wait until the engine admitted (or finished) every choice, so ``num_cached_tokens`` is final.

        Updates read meanwhile are kept and replayed, in order, by :meth:`events`.
        """
        while not all(c.num_cached_tokens is not None or c.finish_reason is not None
                      for c in self._choices.values()):
            update = await self._updates.get()
            choice = self._choices[update.request_id]
            if choice.first_update_ns is None:
                choice.first_update_ns = time.time_ns()
            if update.num_cached_tokens is not None:
                choice.num_cached_tokens = update.num_cached_tokens
            if update.finished and choice.num_cached_tokens is None:
                choice.num_cached_tokens = 0
            self._early.append(update)

    def raise_early_error(self) -> None:
        """After :meth:`wait_admitted`: raise the first error a choice ended with before any output (a refused
        remote prefill), so a stream can still answer it with its own status instead of a 200.

        Raises:
            GenerationError: that choice's error (every other choice is aborted).
        """
        for update in self._early:
            if update.finish_reason == "error":
                self._choices[update.request_id].finish_reason = "error"
                self.abort()
                raise GenerationError(update.error or "the engine failed the request",
                                      update.error_code or "engine_error")

    def start(self) -> None:
        """Submit every choice to the engine (call once, from the event loop)."""
        self._started = True
        self._submitted_ns = time.time_ns()
        prefilled_here = 0  # prompt tokens this worker prefills (a remote prefill counts on the prefill worker)
        for p, prompt in enumerate(self.prompts):
            for i in range(self.n):
                index = p * self.n + i
                rid = f"{self.request_id}-{index}"
                self._choices[rid] = _Choice(index, rid, len(prompt))
                if self.remote_prefill is None:
                    self.engine_loop.submit(rid, prompt, self.make_params(index), self._updates)
                    prefilled_here += len(prompt)
                    continue
                task = asyncio.ensure_future(self.remote_prefill(self.engine_loop, rid, prompt, self.make_params(index),
                                                                 self.sampling, self._updates))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if self.metrics is not None and prefilled_here:
            self.metrics.tokens(num_prompt_tokens=prefilled_here)

    def abort(self) -> None:
        """Abort every unfinished choice (client disconnected or drain timed out)."""
        for task in list(self._tasks):  # hand-offs still fetching the KV end with "abort"
            task.cancel()
        for choice in self._choices.values():
            if choice.finish_reason is None:
                self.engine_loop.abort(choice.request_id)

    @property
    def finished(self) -> bool:
        return self._started and all(c.finish_reason is not None for c in self._choices.values())

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Yield text deltas until every choice finished.

        Raises:
            GenerationError: the engine refused or failed a sequence (other choices are aborted).
        """
        while not self.finished:
            update = self._early.popleft() if self._early else await self._updates.get()
            event = self._apply(self._choices[update.request_id], update)
            if event is not None:
                yield event

    def _apply(self, choice: _Choice, update: SeqUpdate) -> ChoiceEvent | None:
        now = time.monotonic()
        now_ns = time.time_ns() if self.timeline is not None and choice.index == 0 else 0
        if now_ns and choice.first_update_ns is None:
            choice.first_update_ns = now_ns
        if update.num_cached_tokens is not None:
            choice.num_cached_tokens = update.num_cached_tokens
        if update.finish_reason == "error":
            choice.finish_reason = "error"
            self.abort()
            raise GenerationError(update.error or "the engine failed the request", update.error_code or "engine_error")
        if update.new_token_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
                choice.first_token_ns = now_ns
            choice.num_output_tokens += len(update.new_token_ids)
            choice.pending_token_ids.extend(update.new_token_ids)
            if self.metrics is not None:
                self.metrics.tokens(num_generation_tokens=len(update.new_token_ids))
        if not update.finished:
            return self._event(choice, update.new_text) if update.new_text else None
        choice.finish_reason = update.finish_reason or "stop"
        if now_ns:
            self._record_phases(choice, now_ns)
        if self.metrics is not None and choice.finish_reason != "abort" and self.traffic:
            ttft = None if choice.first_token_at is None else choice.first_token_at - self.arrival
            self.metrics.observe_latency(ttft_s=ttft, e2e_s=now - self.arrival,
                                         num_output_tokens=choice.num_output_tokens)
            self.metrics.observe_lengths(
                num_prompt_tokens=choice.num_prompt_tokens, num_output_tokens=choice.num_output_tokens,
                num_cached_tokens=min(choice.num_cached_tokens or 0, choice.num_prompt_tokens))
        return self._event(choice, update.new_text, choice.finish_reason)

    def _record_phases(self, choice: _Choice, end_ns: int) -> None:
        """The first choice's engine phases into :attr:`timeline` (see the class docstring)."""
        timeline = self.timeline
        handoff = [p for p in timeline.phases if p.name == "kv.handoff"]
        queued_ns = handoff[-1].end_ns if handoff else self._submitted_ns
        admitted_ns = choice.first_update_ns or end_ns
        first_ns = choice.first_token_ns or end_ns
        timeline.add("decode.queue", queued_ns, admitted_ns)
        if not handoff:
            timeline.add("prefill", admitted_ns, first_ns, num_prompt_tokens=choice.num_prompt_tokens,
                         num_cached_tokens=choice.num_cached_tokens or 0)
        timeline.add("decode", first_ns if not handoff else admitted_ns, end_ns,
                     num_output_tokens=choice.num_output_tokens, finish_reason=choice.finish_reason or "")
        timeline.attributes.update(num_prompt_tokens=choice.num_prompt_tokens, num_output_tokens=choice.num_output_tokens,
                                   num_cached_tokens=choice.num_cached_tokens or 0, remote_prefill=bool(handoff))

    @staticmethod
    def _event(choice: _Choice, text: str, finish_reason: str | None = None) -> ChoiceEvent:
        token_ids, choice.pending_token_ids = tuple(choice.pending_token_ids), []
        return ChoiceEvent(choice.index, text, finish_reason, token_ids)


def sse(data: dict | str) -> bytes:
    """Frame one server-sent event: ``data: <json>\\n\\n`` (or a raw string such as ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")
