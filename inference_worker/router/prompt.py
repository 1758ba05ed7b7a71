"""Counting a request's prompt tokens the way the worker will (for length-aware routing).

With a tokenizer directory (``tokenizer.json``, optional chat template) the count is exact and
matches the worker server: ``/v1/completions`` string prompts are encoded with special tokens,
chat ``messages`` are rendered with the model's chat template and encoded without adding special
tokens; token-id prompts are counted as given. Without a tokenizer the count of a text is
estimated as ``ceil(utf8_bytes / 4)`` (about 4 bytes per token for English BPE vocabularies).
For a batch of prompts the longest one decides.
"""

from __future__ import annotations

import math
from pathlib import Path


class PromptCounter:
    """Counts prompt tokens of OpenAI completion and chat requests.

    Args:
        tokenizer_dir: directory with ``tokenizer.json`` (and the chat template files), or None to estimate.
    """

    def __init__(self, tokenizer_dir: str | Path | None = None):
        self.tokenizer = self.template = None
        if tokenizer_dir is not None:
            from inference_worker.tokenization import ChatTemplate, load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer_dir)
            self.template = ChatTemplate.for_tokenizer_dir(tokenizer_dir)

    @property
    def exact(self) -> bool:
        """True when a tokenizer is loaded."""
        return self.tokenizer is not None

    def _text(self, text: str, add_special_tokens: bool) -> int:
        if self.tokenizer is None:
            return math.ceil(len(text.encode("utf-8")) / 4)
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def count(self, path: str, body: dict) -> int:
        """Prompt tokens of a request body for ``path`` (0 when there is no prompt)."""
        if path.endswith("/chat/completions"):
            messages = body.get("messages") or []
            if self.template is not None:
                try:
                    return self._text(self.template.render(messages), add_special_tokens=False)
                except ValueError:
                    pass  # the worker will reject it; count the raw contents instead
            return sum(self._text(str(m.get("content", "")), False) for m in messages if isinstance(m, dict))
        prompt = body.get("prompt", "")
        if isinstance(prompt, str):
            return self._text(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, list):
            return max((self.count(path, {"prompt": p}) for p in prompt), default=0)
        return 0
