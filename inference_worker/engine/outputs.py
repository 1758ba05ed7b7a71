"""What the engine returns per request and step (vLLM-style RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """The generated continuation of one request.

    ``token_ids`` and ``text`` are cumulative; ``new_token_ids`` and ``new_text`` are what this step added
    (what a stream sends). ``text`` stops right before a stop string; stop tokens stay in ``token_ids``.
    """

    index: int
    text: str
    token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish_reason: str | None = None
    """``"stop"`` (EOS, stop token or stop string), ``"length"`` (max_tokens or max_model_len), ``"abort"``."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request (None for EOS/length/abort)."""

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times in seconds (``time.monotonic()``) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """State of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int | None = None
    """Prompt tokens not computed for this request: its prefix-cache hit at admission, or for a PD import the
    prefill worker's hit (None until admitted)."""

    @property
    def output(self) -> CompletionOutput:
        """The (single) completion."""
        return self.outputs[0]
