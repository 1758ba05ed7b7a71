"""Scheduler-side state of one generation request (token ids, progress, status); torch-free."""

from __future__ import annotations

import enum
import time
from typing import Any


class RequestStatus(enum.Enum):
    """Life cycle: WAITING (-> WAITING_FOR_KV -> WAITING) -> RUNNING -> (PREEMPTED -> WAITING queue -> RUNNING)* -> FINISHED_*."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_KV = "waiting_for_kv"
    """Parked without blocks while its KV loads from a tier off the step loop (DualPath)."""
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """True for every FINISHED_* status."""
        return self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish reason: ``"stop"``, ``"length"``, ``"abort"``, or None while unfinished."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    """One request as the scheduler sees it.

    Args:
        request_id: unique id.
        prompt_token_ids: prompt tokens (non-empty).
        max_tokens: maximum number of output tokens (>= 1).
        stop_token_ids: token ids that finish the request with ``FINISHED_STOPPED`` (the stop
            token is kept in the output; the engine decides whether to show it).
        sampling_params: opaque reference handed to the model runner (the scheduler never reads it).
        arrival_time: seconds (``time.monotonic()`` when omitted); orders waiting and preemption.
        output_token_ids: tokens already generated elsewhere (a PD-imported request's first token).

    Raises:
        ValueError: on an empty prompt or ``max_tokens`` < 1.

    ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose KV is in the
    cache; it falls back to 0 when the request is preempted (recompute, minus any prefix-cache
    hit at re-admission). ``num_cached_tokens`` is the prefix-cache hit of its first admission
    (None until admitted): the tokens it did not compute, as OpenAI's ``cached_tokens`` reports.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        stop_token_ids: tuple[int, ...] | list[int] = (),
        sampling_params: Any = None,
        arrival_time: float | None = None,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = list(output_token_ids)
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        """True once the status is a FINISHED_* value."""
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
