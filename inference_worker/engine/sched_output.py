"""The contracts between scheduler and model runner: ``SchedulerOutput`` in, ``ModelRunnerOutput`` back.

They are the only objects that cross from the torch-free scheduler to the model runner, which
owns every tensor. Block ids are per KV-cache group, in the order of
``HybridKVCacheManager.groups``. This module never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    """A request the runner has not seen before (first scheduling).

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt; the runner keeps its own copy and appends sampled tokens.
        sampling_params: the engine's sampling parameters, passed through untouched.
        block_ids: the full block table per group (null entries are block 0).
        num_computed_tokens: tokens already in the cache before this step (a prefix-cache hit or
            KV loaded by the connector; 0 without reuse).
        output_token_ids: tokens generated elsewhere before admission (a PD import's first token).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request the runner already holds state for (continuing, or resumed after preemption).

    Attributes:
        request_id: the request's id.
        resumed_from_preemption: True when the request was preempted and its blocks freed; then
            ``new_block_ids`` is its complete new block table per group and the runner must
            replace (not extend) its tables and recompute from ``num_computed_tokens`` (0).
        new_block_ids: block ids appended to each group's table this step.
        num_computed_tokens: tokens whose KV is in the cache before this step.
    """

    request_id: str
    resumed_from_preemption: bool
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """Everything the model runner needs for one step.

    Attributes:
        scheduled_new_reqs: first-time requests.
        scheduled_cached_reqs: continuing or resumed requests.
        num_scheduled_tokens: tokens to compute this step per request id (a prefill chunk, or 1
            for a decode).
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens`` (<= ``max_num_batched_tokens``).
        finished_req_ids: requests finished or aborted since the previous step; the runner drops
            their state.
        preempted_req_ids: requests preempted in this step; the runner keeps their token ids and
            sampler state but forgets their block tables.
        num_cached_tokens: per request admitted for the first time this step, its prefix-cache
            hit in tokens (reported to clients before the first token).
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """True when nothing is to be computed this step."""
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What the runner sends back after a step.

    Attributes:
        sampled_token_ids: per scheduled request id, the tokens sampled this step: one token when
            the step reached the end of the request's known tokens, none for a partial prefill
            chunk.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """Scheduler-to-engine result for one request after a step.

    Attributes:
        request_id: the request's id.
        new_token_ids: tokens appended to the output this step.
        finish_reason: ``"stop"`` or ``"length"`` when the request finished this step, else None.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
