"""Bounds on OpenAI-style request bodies, shared by the router and the worker server (torch-free).

What a client can make a Ferry process hold or compute is bounded before the work starts:

- the body size (:func:`read_body_capped`: 413 before the body is buffered past the cap); the default cap
  is :func:`default_max_body_bytes` of the model's max context;
- JSON that Python would accept but a tokenizer or the engine cannot (:func:`parse_json_body`): the
  non-standard constants ``NaN``/``Infinity`` and numbers that overflow to infinity (``1e400``), lone
  UTF-16 surrogates (``"\\ud800"``, which cannot be encoded as UTF-8), and nesting deeper than
  :data:`MAX_JSON_DEPTH`;
- the number of sequences one request asks for (:func:`check_request_size`): ``n`` up to
  :data:`MAX_N` and a ``prompt`` batch up to ``max_prompts`` (default :data:`DEFAULT_MAX_PROMPTS`).

Every refusal is an :class:`~inference_worker.server.errors.OpenAIError` (400 ``invalid_request_error``,
413 ``request_too_large``) naming what was wrong and the limit.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from inference_worker.server.errors import OpenAIError, invalid

MAX_N = 16
"""Most choices per prompt (``n``)."""
DEFAULT_MAX_PROMPTS = 64
"""Default most prompts in one ``/v1/completions`` batch."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays/objects accepted (a chat request needs 4)."""
BODY_BYTES_PER_TOKEN = 32
"""Body bytes allowed per token of context: a token is 2-16 bytes of UTF-8 text on average for BPE
vocabularies, a JSON-escaped non-ASCII character costs up to 12 bytes (a surrogate pair of ``\\uXXXX``),
and a token id in a JSON list at most 8 (``262143, ``); 32 bytes covers a full context of any of these."""
BODY_OVERHEAD_BYTES = 64 << 10
"""Bytes allowed for everything but the prompt (options, chat roles, stop strings)."""


def default_max_body_bytes(max_context_tokens: int) -> int:
    """Body size cap for a model of ``max_context_tokens``: ``64 KiB + 32 B * max_context_tokens``
    (Gemma 3 270M, 32768 tokens: 1,114,112 bytes).

    Raises:
        ValueError: ``max_context_tokens`` < 1.
    """
    if max_context_tokens < 1:
        raise ValueError(f"max_context_tokens must be positive, got {max_context_tokens}")
    return BODY_OVERHEAD_BYTES + BODY_BYTES_PER_TOKEN * max_context_tokens


def too_large(max_bytes: int) -> OpenAIError:
    """A 413 for a body over ``max_bytes``."""
    return OpenAIError(413, f"request body too large: this route accepts at most {max_bytes} bytes",
                       code="request_too_large")


async def read_body_capped(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``max_bytes``.

    A ``Content-Length`` over the cap is refused before any of the body is read; a chunked (or lying)
    body is read chunk by chunk and refused as soon as the bytes received pass the cap, so at most
    ``max_bytes`` plus one ASGI chunk is ever buffered.

    Raises:
        OpenAIError: 413 ``request_too_large``; 400 for a malformed ``Content-Length``.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isascii() or not declared.isdigit() or len(declared) > 19:
            raise OpenAIError(400, "invalid Content-Length header", code="invalid_value")
        if int(declared) > max_bytes:
            raise too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict:
    """Parse a request body as a JSON object of finite numbers and encodable strings.

    Raises:
        OpenAIError: 400 ``invalid_json`` for malformed JSON, ``NaN``/``Infinity``, nesting deeper than
            :data:`MAX_JSON_DEPTH` or invalid UTF-8; 400 ``invalid_value`` for a number that overflows to
            infinity or a string with a lone surrogate; 400 ``invalid_type`` for a non-object body.
    """
    if not raw.strip():
        raise invalid("request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise invalid(f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digits limit, NaN/Infinity
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object", code="invalid_type")
    _check_values(body)
    return body


def _check_values(root: Any) -> None:
    """Walk the parsed body iteratively (no recursion: depth is what is being checked)."""
    stack: list[tuple[Any, int, str]] = [(root, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid(f"'{where}' contains a lone UTF-16 surrogate, which is not valid Unicode text",
                              param=where.split(".")[0].split("[")[0] or None) from None
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise invalid(f"'{where}' must be a finite number", param=where.split(".")[0].split("[")[0])
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise invalid(f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth + 1, where))
                name = f"{where}.{key}" if isinstance(key, str) and where else (key if isinstance(key, str)
                                                                                 else f"{where}[{key}]")
                if isinstance(item, str | float | dict | list):
                    stack.append((item, depth + 1, name))


def num_prompts(prompt: Any) -> int:
    """Prompts in a completions ``prompt``: 1 for a string or a list of token ids, else the list's length."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


def check_request_size(body: dict, *, max_prompts: int = DEFAULT_MAX_PROMPTS) -> None:
    """Refuse a request for more sequences than allowed: ``n`` over :data:`MAX_N` or a ``prompt`` batch of more
    than ``max_prompts``. Types are not checked here (the worker's schema does).

    Raises:
        OpenAIError: 400 naming ``n`` or ``prompt`` and the limit.
    """
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        raise invalid(f"n must be at most {MAX_N}, got {n}", param="n")
    count = num_prompts(body.get("prompt"))
    if count > max_prompts:
        raise invalid(f"a batch may hold at most {max_prompts} prompts, got {count}; split it into several "
                      f"requests", param="prompt", code="too_many_prompts")
