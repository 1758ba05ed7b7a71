"""Counting a request's prompt tokens the way the worker will (for length-aware routing).

With a tokenizer directory (``tokenizer.json``, optional chat template) the count is exact and
matches the worker server: ``/v1/completions`` string prompts are encoded with special tokens,
chat ``messages`` are rendered with the model's chat template and encoded without adding special
tokens; token-id prompts are counted as given. Without a tokenizer the count of a text is
estimated as ``ceil(utf8_bytes / 4)`` (about 4 bytes per token for English BPE vocabularies).
For a batch of prompts the longest one decides.

:class:`PromptHasher` keeps one tokenizer per model version (the routing table's tokenizer reference)
and turns a request into a :class:`~.pipeline.PromptInfo`: token count and block digests salted like
the workers' (``block_hash.prefix_root`` of the version's weights sha256, KV dtype and block size). It
is called on the router's prompt thread pool (on the event loop itself only for short bodies, whose tokenizing and
hashing cost less than the hand-off: ``app.INLINE_BODY_BYTES``). Texts are
encoded with ``Tokenizer.encode_batch_fast``, which releases the GIL while it works (``encode`` holds it for the
whole call, so a thread running it still froze the loop: about 3 s for a 1 MB prompt on this machine) and skips the
character offsets ``encode_batch`` computes.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

from inference_worker.engine.block_hash import block_digests, prefix_root
from inference_worker.router.pipeline import PromptInfo
from inference_worker.router.table import ModelInfo

log = logging.getLogger(__name__)


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
        return len(self._encode(text, add_special_tokens))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (``encode_batch_fast``: the GIL is released while the tokenizer runs, and no character
        offsets are computed, which the router never reads: the same ids for ~20% less CPU on a 4K-token prompt)."""
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def token_ids(self, path: str, body: dict) -> list[int] | None:
        """The single prompt's token ids exactly as the worker computes them, or None (no tokenizer, a batch of
        prompts, or a chat request the template rejects)."""
        if path.endswith("/chat/completions"):
            if self.tokenizer is None or self.template is None:
                return None
            try:
                text = self.template.render(body.get("messages") or [])
            except ValueError:
                return None
            return self._encode(text, False)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self._encode(prompt, True)
        return None

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


def resolve_tokenizer(reference: str) -> Path | None:
    """Directory holding ``tokenizer.json`` for a routing-table tokenizer reference, or None.

    ``file:///path`` or a path (a file's directory is used), else a built-in model name prepared in the
    model cache (``$FERRY_MODEL_CACHE`` or ``~/.cache/ferry/models``).
    """
    if not reference:
        return None
    from inference_worker.registry import model_cache_dir

    path = Path(reference.removeprefix("file://"))
    if not path.is_absolute():
        path = path if path.exists() else model_cache_dir() / reference
    if path.is_file():
        path = path.parent
    return path if (path / "tokenizer.json").is_file() else None


class PromptHasher:
    """One tokenizer per model version; turns requests into :class:`PromptInfo` (thread-safe).

    Args:
        default_tokenizer_dir: used to count tokens of versions without a tokenizer reference (``--tokenizer``).
    """

    def __init__(self, default_tokenizer_dir: str | Path | None = None):
        self.default = PromptCounter(default_tokenizer_dir)
        self._counters: dict[tuple[str, str], PromptCounter | None] = {}
        self._lock = threading.Lock()

    def counter_for(self, version: str, info: ModelInfo) -> PromptCounter | None:
        """The version's tokenizer (loaded once), or None when its reference is missing or does not resolve."""
        key = (version, info.tokenizer)
        with self._lock:
            if key not in self._counters:
                directory = resolve_tokenizer(info.tokenizer)
                counter = None
                if directory is not None:
                    try:
                        counter = PromptCounter(directory)
                    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on a bad file
                        log.warning("tokenizer of %s at %s does not load (cache scoring off): %s", version, directory,
                                    exc)
                self._counters[key] = counter
            return self._counters[key]

    def loaded(self, version: str, info: ModelInfo) -> bool:
        """Whether :meth:`counter_for` has already tried to load the version's tokenizer (loaded or not: the next
        call does no file or tokenizer work)."""
        return (version, info.tokenizer) in self._counters

    def info(self, version: str, info: ModelInfo, path: str, body: dict, *, hashing: bool = True) -> PromptInfo:
        """Token count and block digests of the request for ``version`` (cache state per ``pipeline.CACHE_STATES``)."""
        counter = self.counter_for(version, info)
        if counter is None:
            return PromptInfo(self.default.count(path, body), (), "no_tokenizer")
        ids = counter.token_ids(path, body)
        if ids is None:
            return PromptInfo(counter.count(path, body), (), "no_tokenizer")
        if not info.can_hash:
            return PromptInfo(len(ids), (), "no_digest_salt")
        if not hashing:
            return PromptInfo(len(ids), (), "policy")
        root = prefix_root(info.weights_sha256, info.kv_dtype, info.block_size)
        try:
            return PromptInfo(len(ids), tuple(block_digests(root, ids, info.block_size)), "on")
        except ValueError:  # token ids outside uint32: the worker answers 400; nothing to look up
            return PromptInfo(len(ids), (), "unhashable")
