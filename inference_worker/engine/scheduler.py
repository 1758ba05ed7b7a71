"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute; torch-free.

Each ``schedule()`` call decides which requests compute how many tokens in the next model step
and returns a ``SchedulerOutput``; ``update_from_output()`` takes the sampled tokens back,
applies stop conditions and frees finished requests' blocks. There is no separate prefill or
decode phase: a request simply has ``num_tokens - num_computed_tokens`` tokens left to
compute (the whole prompt at first, one token per step once decoding), and prefill chunks and
decodes share each step's ``max_num_batched_tokens`` budget.

At admission (new or preempted) a request's tokens already available are counted as computed:
KV a connector provides (:mod:`~inference_worker.engine.kv_connector`, e.g. a PD import), else
the prefix-cache hit of the KV cache manager (a preempted request may hit its own blocks). After
each step the blocks filled with computed KV are registered in the prefix cache.
"""

from __future__ import annotations

import bisect
import itertools

from inference_worker.engine.kv_cache_manager import SLIDING_ATTENTION, HybridKVCacheManager, cdiv
from inference_worker.engine.kv_connector import KVConnector
from inference_worker.engine.request import Request, RequestStatus
from inference_worker.engine.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestUpdate,
    SchedulerOutput,
)


class Scheduler:
    """FCFS continuous batching over a ``HybridKVCacheManager``.

    Args:
        kv_cache_manager: the block accounting to allocate from.
        max_num_seqs: most requests running at once (>= 1).
        max_num_batched_tokens: most tokens computed in one step, prefill chunks and decodes
            together (>= 1).
        max_model_len: most tokens (prompt + output) per request; a request reaching it
            finishes with reason ``"length"``.
        connector: the KV connector (external KV in and out); the no-op base when None.

    Raises:
        ValueError: on a limit below 1.
    """

    def __init__(
        self,
        kv_cache_manager: HybridKVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        connector: KVConnector | None = None,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector or KVConnector()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by arrival (preempted requests go back in place)
        self.running: list[Request] = []  # sorted by arrival; the tail is preempted first
        self.loading: dict[str, Request] = {}  # parked while a connector loads their KV (WAITING_FOR_KV)
        self._order: dict[str, tuple[float, int]] = {}
        self._counter = itertools.count()
        self._finished_req_ids: set[str] = set()

    # ---- queue helpers -------------------------------------------------------------------

    def _key(self, request: Request) -> tuple[float, int]:
        return self._order[request.request_id]

    def _insert_sorted(self, queue: list[Request], request: Request) -> None:
        keys = [self._key(r) for r in queue]
        queue.insert(bisect.bisect(keys, self._key(request)), request)

    def max_blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Blocks per group (``kv_cache_manager.groups`` order) a request can hold at its peak.

        Full attention holds every block of ``min(prompt + max_tokens, max_model_len)`` tokens; sliding
        attention at most the blocks of its window plus one step's tokens (and never more than full).
        """
        bs = self.kv_cache_manager.block_size
        max_len = min(num_prompt_tokens + max_tokens, self.max_model_len)
        needed = []
        for group in self.kv_cache_manager.groups:
            if group.attention_type == SLIDING_ATTENTION:
                needed.append(min(cdiv(max_len, bs), self._window_peak(group.sliding_window)))
            else:
                needed.append(cdiv(max_len, bs))
        return needed

    def _window_peak(self, sliding_window: int) -> int:
        return cdiv(sliding_window - 1 + self.max_num_batched_tokens, self.kv_cache_manager.block_size) + 1

    def capacity_error(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size could never fit in the KV cache (even alone), or None when it can.

        Reads only the cache's fixed geometry: safe to call from another thread.
        """
        usable = self.kv_cache_manager.get_num_usable_blocks()
        needed = self.max_blocks_needed(num_prompt_tokens, max_tokens)
        for group, need, have in zip(self.kv_cache_manager.groups, needed, usable, strict=True):
            if need > have:
                return (f"needs up to {need} {group.attention_type} blocks but the KV cache has {have}; "
                        "raise --kv-cache-memory or lower max_tokens")
        return None

    def max_request_tokens(self) -> int:
        """Most prompt + output tokens one request can hold: ``max_model_len`` capped by the KV cache.

        A full group of ``n`` usable blocks holds ``n * block_size`` tokens; a sliding group bounds the
        length only when its window peak (:meth:`max_blocks_needed`) exceeds its blocks. Consistent with
        :meth:`capacity_error`: ``capacity_error(p, m) is None`` iff ``min(p + m, max_model_len) <=`` this.
        """
        limit = self.max_model_len
        bs = self.kv_cache_manager.block_size
        for group, have in zip(self.kv_cache_manager.groups, self.kv_cache_manager.get_num_usable_blocks(),
                               strict=True):
            if group.attention_type == SLIDING_ATTENTION and self._window_peak(group.sliding_window) <= have:
                continue
            limit = min(limit, have * bs)
        return limit

    # ---- public API ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: if the id is already in use, the prompt is not shorter than
                ``max_model_len``, or the request could never fit in some group's pool.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_prompt_tokens} tokens, "
                f"max_model_len is {self.max_model_len}; shorten the prompt"
            )
        error = self.capacity_error(request.num_prompt_tokens, request.max_tokens)
        if error is not None:
            raise ValueError(f"request {request.request_id!r} {error}")
        self.requests[request.request_id] = request
        self._order[request.request_id] = (request.arrival_time, next(self._counter))
        request.status = RequestStatus.WAITING
        self._insert_sorted(self.waiting, request)

    @property
    def num_waiting(self) -> int:
        """Requests waiting (new or preempted, or parked while their KV loads)."""
        return len(self.waiting) + len(self.loading)

    @property
    def num_running(self) -> int:
        """Requests holding blocks."""
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running or self.loading)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._insert_sorted(self.waiting, request)

    def schedule(self) -> SchedulerOutput:
        """Choose the tokens of the next step.

        Algorithm: the step has a budget of ``max_num_batched_tokens`` tokens. Running requests
        are served first, oldest first: each gets ``min(tokens left to compute, budget left)``
        (a prefill chunk or one decode token). If its blocks cannot be allocated, the newest
        running request (the tail of the arrival-sorted list) is preempted — its blocks freed
        and its ``num_computed_tokens`` reset to 0 so it recomputes prompt and output later —
        and allocation is retried; if the request itself is the newest, it is preempted and
        the pass ends. Only when nothing was preempted in this step are waiting requests
        admitted, oldest first (resumed ones in arrival order among them), while fewer than
        ``max_num_seqs`` run and budget remains; a prompt longer than the budget is chunked;
        the first request whose blocks do not fit stops admission (FCFS, no skipping). An
        admitted request starts from the tokens available to it: the connector's external KV,
        or else the prefix-cache hit (its blocks adopted in the same all-or-nothing allocation). A
        request whose KV the connector must first load (a KV tier, ``load_async``) is parked without
        blocks (``WAITING_FOR_KV``) and the next waiting request is considered; it rejoins the waiting
        queue in arrival order once the connector reports the load finished (DualPath).
        Finally each scheduled request's ``num_computed_tokens`` advances by its scheduled
        count.
        """
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        output = SchedulerOutput()
        for request_id in self.connector.get_finished_loads():
            parked = self.loading.pop(request_id, None)
            if parked is not None:
                parked.status = RequestStatus.WAITING
                self._insert_sorted(self.waiting, parked)
        scheduled: list[tuple[Request, int]] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            new_block_ids = kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
                new_block_ids = kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if new_block_ids is None:
                break
            output.scheduled_cached_reqs.append(
                CachedRequestData(
                    request_id=request.request_id,
                    resumed_from_preemption=False,
                    new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1

        if not output.preempted_req_ids:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hit, computed_blocks = 0, None
                external = self.connector.get_num_new_matched_tokens(request, request.num_computed_tokens)
                if external is not None and external.load_async:  # DualPath: park it; others go on
                    self.waiting.pop(0)
                    request.status = RequestStatus.WAITING_FOR_KV
                    self.loading[request.request_id] = request
                    continue
                if external is None and request.num_computed_tokens == 0:
                    hit, computed_blocks = kv.get_computed_blocks(
                        request.request_id, request.prompt_token_ids, request.output_token_ids)
                num_computed = request.num_computed_tokens + hit + (external.num_tokens if external else 0)
                num_new = min(request.num_tokens - num_computed, budget)
                if kv.allocate_slots(request.request_id, num_computed, num_new, computed_blocks) is None:
                    break
                if external is not None:
                    kv.set_first_registrable_blocks(request.request_id, list(external.first_positions))
                    self.connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), external)
                elif kv.enable_prefix_caching:
                    kv.record_query(request.num_tokens, hit)
                request.num_computed_tokens = num_computed
                hit += external.num_cached_tokens if external is not None else 0
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = hit
                    output.num_cached_tokens[request.request_id] = hit
                self.waiting.pop(0)
                resumed = request.status == RequestStatus.PREEMPTED
                request.status = RequestStatus.RUNNING
                self._insert_sorted(self.running, request)
                block_ids = kv.get_block_ids(request.request_id)
                if resumed:
                    output.scheduled_cached_reqs.append(
                        CachedRequestData(request.request_id, True, block_ids, request.num_computed_tokens)
                    )
                else:
                    output.scheduled_new_reqs.append(
                        NewRequestData(
                            request_id=request.request_id,
                            prompt_token_ids=list(request.prompt_token_ids),
                            sampling_params=request.sampling_params,
                            block_ids=block_ids,
                            num_computed_tokens=request.num_computed_tokens,
                            output_token_ids=list(request.output_token_ids),
                        )
                    )
                scheduled.append((request, num_new))
                budget -= num_new

        for request, num_new in scheduled:
            output.num_scheduled_tokens[request.request_id] = num_new
            request.num_computed_tokens += num_new
        output.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        output.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append sampled tokens, apply stop conditions and free finished requests.

        A request stops with ``"stop"`` when a sampled token is in its ``stop_token_ids``, and
        with ``"length"`` when its output reaches ``max_tokens`` or prompt + output reaches
        ``max_model_len``. Requests aborted since the step was scheduled are ignored.

        Raises:
            ValueError: if the runner sampled for a request whose known tokens are not all
                computed (a partial prefill chunk must not sample).
        """
        updates = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            token_ids = runner_output.sampled_token_ids.get(request_id, [])
            if not token_ids:
                self.kv_cache_manager.cache_blocks(request_id, request.num_computed_tokens,
                                                   request.prompt_token_ids, request.output_token_ids)
                continue
            if request.num_computed_tokens != request.num_tokens:
                raise ValueError(
                    f"runner sampled for {request_id!r} after a partial prefill "
                    f"({request.num_computed_tokens}/{request.num_tokens} tokens computed)"
                )
            new_token_ids = []
            status = None
            for token_id in token_ids:
                request.output_token_ids.append(token_id)
                new_token_ids.append(token_id)
                if token_id in request.stop_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
                    status = RequestStatus.FINISHED_LENGTH_CAPPED
                if status is not None:
                    break
            self.kv_cache_manager.cache_blocks(request_id, request.num_computed_tokens,
                                               request.prompt_token_ids, request.output_token_ids)
            if status is not None:
                self._finish(request, status)
            updates.append(RequestUpdate(request_id, new_token_ids, status.finish_reason if status else None))
        return updates

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            del self.loading[request.request_id]
        else:
            self.waiting.remove(request)
        request.status = status
        self.connector.request_finished(request, self.kv_cache_manager.get_block_ids(request.request_id))
        self.kv_cache_manager.free(request.request_id)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        del self._order[request.request_id]

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): their blocks are freed at once.

        Unknown or already finished ids are ignored (an abort may race with a normal finish).

        Raises:
            ValueError: if ``status`` is not a FINISHED_* value.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* value, got {status}")
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
