"""Per-request sampling parameters (vLLM/OpenAI names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick output tokens and when to stop.

    Call :meth:`validate` (the engine does) to check the values.
    """

    max_tokens: int = 16
    """Maximum number of output tokens (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p (0 < top_p <= 1)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 or -1 = no limit)."""
    seed: int | None = None
    """Per-request RNG seed: the same seed and prompt give the same sample regardless of batch."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: the output text is cut right before the first one, finish_reason ``"stop"``."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end generation (kept in ``token_ids``, not shown in the text)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens (benchmarks)."""

    def validate(self) -> SamplingParams:
        """Check every field; returns ``self``.

        Raises:
            ValueError: naming the field, its value and the allowed range.
        """
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (or -1 for no limit), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        return self

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0
