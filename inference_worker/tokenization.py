"""Text <-> token plumbing for the worker server: incremental detokenization and chat templates.

Two pieces live here because the server needs them and the engine does not:

- :class:`IncrementalDetokenizer` turns a growing list of generated token ids into text deltas
  that are safe to stream. A delta never ends inside a multi-byte UTF-8 character (byte-fallback
  tokenizers such as Gemma's decode an incomplete character as U+FFFD; such text is held back
  until the character completes) and never contains text that might still turn out to be the
  start of a stop string (held back until it can no longer match). Joining every delta gives the
  same text a non-streamed request returns, trimmed right before the first stop string.
- :class:`ChatTemplate` renders OpenAI ``messages`` into a prompt string with the model's own
  jinja2 chat template (HF convention: variables ``messages``, ``bos_token``, ``eos_token``,
  ``add_generation_prompt``). The Gemma 3 GGUF carries no template, so :data:`GEMMA_CHAT_TEMPLATE`
  implements Gemma's documented turn format (``<start_of_turn>user`` / ``<start_of_turn>model``
  turns closed by ``<end_of_turn>``; a system message is prepended to the first user turn, since
  Gemma has no system role).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + (message['content'] | trim) + '\\n\\n' %}"
    "{% else %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = 'user' %}{% endif %}"
    "<start_of_turn>{{ role }}\n"
    "{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma's documented turn format (ai.google.dev "Gemma formatting and system instructions")."""

# Tokens that end an assistant turn, by chat format; used as extra stop token ids for chat requests.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")


class ChatTemplateError(ValueError):
    """Raised when messages are malformed or the template cannot render them."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizers`` tokenizer from a ``tokenizer.json`` file or a directory holding one.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` at ``path``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}; prepare the model first")
    return Tokenizer.from_file(str(path))


class IncrementalDetokenizer:
    """Streams the text of one sequence's generated tokens, with stop-string and UTF-8 hold-back.

    Decoding runs over a small window of recent tokens (``prefix_offset``..end) rather than
    the whole sequence: the text of ``ids[prefix_offset:read_offset]`` is decoded both alone and
    with the new tokens appended, and the difference is the new text. Starting both decodes at
    the same token keeps decoder effects that depend on position (leading-space handling) out of
    the difference. When the new text ends in U+FFFD the tokens so far end inside a UTF-8
    character, so nothing is released and the window waits for more tokens.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer``.
        stop: stop strings; generation output ends right before the earliest one found.
        skip_special_tokens: leave special tokens (``<eos>``, ``<end_of_turn>``) out of the text.

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, skip_special_tokens: bool = True):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._decoded = ""  # all text decoded so far (complete characters only), before stop trimming
        self._emitted = 0  # number of characters of _decoded already released
        self.stop_string: str | None = None
        """The stop string that ended the text, once one was found."""

    @property
    def token_ids(self) -> list[int]:
        """All token ids pushed so far."""
        return list(self._ids)

    @property
    def text(self) -> str:
        """The text released so far (what a stream has sent)."""
        return self._decoded[: self._emitted]

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found; no further text will be released."""
        return self.stop_string is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated token ids; return the text that is now safe to send (maybe "").

        Once a stop string has been found, further pushes return "" and :attr:`stopped` is True.
        """
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._decoded += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Release everything still held back (generation ended without a stop string).

        An incomplete UTF-8 character at the very end is decoded as U+FFFD, exactly as a
        non-streamed decode of the same tokens would show it.
        """
        if self.stopped:
            return ""
        tail = self._decode(self._ids[self._prefix_offset :])
        done = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if len(tail) > len(done):
            self._decoded += tail[len(done) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self._stop:
            # A stop string may start up to max_stop_len - 1 characters before the released text.
            search_from = max(0, self._emitted - self._max_stop_len + 1)
            hits = [(i, s) for s in self._stop if (i := self._decoded.find(s, search_from)) >= 0]
            if hits:
                index, stop = min(hits)
                self.stop_string = stop
                self._decoded = self._decoded[:index]
                return self._advance(index)
        end = len(self._decoded)
        if not final and self._stop:
            end -= self._held_back_chars()
        return self._advance(end)

    def _held_back_chars(self) -> int:
        """Length of the longest suffix of the decoded text that is a proper prefix of a stop string."""
        text = self._decoded
        for k in range(min(self._max_stop_len - 1, len(text) - self._emitted), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self._stop):
                return k
        return 0

    def _advance(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        return delta


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja2 chat template plus the special tokens it refers to.

    Attributes:
        source: the jinja2 template text.
        bos_token / eos_token: strings the template may insert.
        is_builtin_fallback: True when the model shipped no template and Gemma's documented
            turn format is used instead.
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    is_builtin_fallback: bool = False

    @classmethod
    def for_tokenizer_dir(cls, directory: str | Path) -> ChatTemplate | None:
        """Read the template from a prepared tokenizer directory.

        Looks at ``chat_template.jinja``, then ``tokenizer_config.json``'s ``chat_template``. With
        neither, a Gemma tokenizer (the Gemma 3 GGUF has no template) gets
        :data:`GEMMA_CHAT_TEMPLATE`; any other model gets None (it has no chat format).
        """
        directory = Path(directory)
        config: dict = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            return cls(jinja_path.read_text(encoding="utf-8"), bos, eos)
        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows a list of named templates
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if isinstance(template, str) and template:
            return cls(template, bos, eos)
        if str(config.get("tokenizer_class", "")).startswith("Gemma"):
            return cls(GEMMA_CHAT_TEMPLATE, bos or "<bos>", eos or "<eos>", is_builtin_fallback=True)
        return None

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """Render OpenAI chat ``messages`` to a prompt string.

        Each message needs ``role`` (system, developer, user or assistant) and ``content``: a
        string or a list of ``{"type": "text", "text": ...}`` parts, which are concatenated.

        Raises:
            ChatTemplateError: empty or malformed messages, or the template raised.
        """
        normalized = [_normalize_message(i, m) for i, m in enumerate(messages)]
        if not normalized:
            raise ChatTemplateError("messages must contain at least one message")
        try:
            template = _compile(self.source)
            return template.render(
                messages=normalized,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render the messages: {exc}") from exc


def end_of_turn_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of the tokens that close an assistant turn in the tokenizer's chat format (may be empty)."""
    ids = [tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS]
    return [i for i in ids if i is not None]


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # older HF configs store AddedToken dicts
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _normalize_message(index: int, message: object) -> dict:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise ChatTemplateError(
            f"messages[{index}].role must be one of system, developer, user, assistant; got {role!r}"
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(
                    f"messages[{index}].content[{j}] must be {{'type': 'text', 'text': <string>}}; "
                    "only text content is supported"
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
    return {"role": role, "content": content}


@functools.cache
def _compile(source: str) -> jinja2.Template:
    """Compile a chat template once per distinct source (HF's sandboxed environment settings)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
