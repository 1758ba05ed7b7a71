"""Request schemas of the OpenAI-compatible API and their validation.

Bodies are parsed with pydantic in strict mode (``"5"`` is not an integer, ``1.5`` is not an
integer, ``true`` is not a number) and every failure becomes an :class:`OpenAIError` naming the
field. Documented choices:

- ``max_tokens: 0`` is rejected with 400 (``max_tokens`` must be at least 1), like negative values.
  Omitted ``max_tokens`` means 16 for ``/v1/completions`` (OpenAI's default) and "up to the
  context length" for ``/v1/chat/completions``.
- ``prompt`` may be a string, a list of token ids, or a batch (a list of strings or of token-id
  lists); choice ``index`` is ``prompt_index * n + i``.
- ``top_k`` of -1 or 0 disables top-k; ``temperature: 0`` is greedy decoding; numbers must be finite
  (``Infinity``, ``NaN`` and ``1e400`` are 400s).
- ``n`` is at most 16 and a ``prompt`` batch holds at most the worker's ``--max-prompts`` prompts
  (default 64; :mod:`inference_worker.request_limits`).
- Unsupported OpenAI options with a non-default value (``logprobs``, ``echo``, ``suffix``,
  ``best_of`` > n, non-zero penalties, ``logit_bias``, ``tools``) are rejected rather than ignored.
- ``return_token_ids`` (vLLM's request option, same name and field placement): when true the response
  carries the ids. Completions: every choice has ``prompt_token_ids`` (its prompt) and ``token_ids``
  (every id generated for it, the EOS or stop-completing token included, as ``completion_tokens`` counts
  them). Chat: ``prompt_token_ids`` (the rendered conversation) sits on the response, ``token_ids`` on each
  choice. Streamed, a chunk's ``token_ids`` are the ids since the choice's previous chunk, and
  ``prompt_token_ids`` comes once, in the first chunk (of each choice for completions; top-level in the
  first chunk for chat). A non-boolean value is a 400 naming ``return_token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inference_worker.request_limits import DEFAULT_MAX_PROMPTS, MAX_N
from inference_worker.server.errors import OpenAIError, invalid

MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16

_TYPE_HINTS = {
    "stop": "a string or a list of strings",
    "max_tokens": "an integer",
    "max_completion_tokens": "an integer",
    "n": "an integer",
    "seed": "an integer",
    "top_k": "an integer",
    "temperature": "a number",
    "top_p": "a number",
    "stream": "a boolean",
    "return_token_ids": "a boolean",
    "model": "a string",
    "messages": "a list of message objects",
    "stream_options": "an object like {\"include_usage\": true}",
    "stream_options.include_usage": "a boolean",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    include_usage: bool = False


class _CommonRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool | None = None
    # Accepted only at their default values (see the module docstring).
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None


class CompletionRequest(_CommonRequest):
    """Body of ``POST /v1/completions``."""

    prompt: Any = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_CommonRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[Any]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None


@dataclass(frozen=True)
class SamplingRequest:
    """The sampling options of one API request, validated; ``max_tokens`` None = up to context."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool = False


def parse_body(raw: bytes, model_cls: type[_CommonRequest]) -> _CommonRequest:
    """Parse and validate a JSON request body.

    Raises:
        OpenAIError: 400 for malformed JSON, a non-object body, wrong types or out-of-range values.
    """
    if not raw.strip():
        raise invalid("request body is empty; send a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None


def _from_validation_error(exc: ValidationError) -> OpenAIError:
    error = exc.errors(include_url=False)[0]
    kind, loc = error["type"], [p for p in error["loc"]]
    if kind == "json_invalid":
        return invalid(f"request body is not valid JSON: {error['msg']}", code="invalid_json")
    if not loc:
        return invalid("request body must be a JSON object", code="invalid_type")
    field = str(loc[0])
    param = field
    if field == "stream_options" and len(loc) > 1 and loc[1] == "include_usage":
        param = "stream_options.include_usage"
    if kind == "missing":
        return invalid(f"'{param}' is required", param=param, code="missing_required_parameter")
    if kind.endswith("_type") or kind.endswith("_parsing") or kind in ("union_tag_invalid", "model_attributes_type"):
        expected = _TYPE_HINTS.get(param, "of another type")
        shown = error.get("input")
        return invalid(f"'{param}' must be {expected}; got {shown!r}", param=param, code="invalid_type")
    return invalid(f"invalid value for '{param}': {error['msg']}", param=param)


def sampling_request(body: _CommonRequest, *, max_tokens: int | None) -> SamplingRequest:
    """Check the options pydantic cannot express and collect them.

    Raises:
        OpenAIError: 400 for max_tokens < 1, bad stop strings, unsupported options.
    """
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens} (max_tokens: 0 is rejected)",
                      param="max_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", param="stop")
    if any(s == "" for s in stop):
        raise invalid("stop strings must be non-empty", param="stop")
    if body.logprobs not in (None, False, 0):
        raise invalid("logprobs are not supported by this server", param="logprobs", code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise invalid(f"{name} is not supported; send 0 or omit it", param=name, code="unsupported_parameter")
    if body.logit_bias:
        raise invalid("logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    return SamplingRequest(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=-1 if body.top_k in (0, -1) else body.top_k, seed=body.seed, stop=stop, n=body.n,
        ignore_eos=body.ignore_eos, stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=bool(body.return_token_ids),
    )


def completion_sampling(body: CompletionRequest) -> SamplingRequest:
    """Sampling options of a completions request (max_tokens defaults to 16)."""
    if body.echo:
        raise invalid("echo is not supported", param="echo", code="unsupported_parameter")
    if body.suffix:
        raise invalid("suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return sampling_request(body, max_tokens=max_tokens)


def chat_sampling(body: ChatCompletionRequest) -> SamplingRequest:
    """Sampling options of a chat request (``max_completion_tokens`` wins over ``max_tokens``)."""
    if body.tools:
        raise invalid("tools are not supported", param="tools", code="unsupported_parameter")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return sampling_request(body, max_tokens=max_tokens)


def completion_prompts(prompt: Any, max_prompts: int = DEFAULT_MAX_PROMPTS) -> list[str | list[int]]:
    """Split a completions ``prompt`` into single prompts (string or token ids).

    Raises:
        OpenAIError: 400 when the prompt is missing, empty, of the wrong type, or a batch of more than
            ``max_prompts``.
    """
    if prompt is None:
        raise invalid("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise invalid("prompt must not be empty", param="prompt")
    else:
        raise invalid("prompt must be a string, a list of token ids, or a list of those",
                      param="prompt", code="invalid_type")
    if len(prompts) > max_prompts:
        raise invalid(f"a batch may hold at most {max_prompts} prompts, got {len(prompts)}; split it into several "
                      f"requests", param="prompt", code="too_many_prompts")
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, list) and not all(_is_token_id(t) for t in p):
            raise invalid(f"{where} must be a list of non-negative integer token ids", param="prompt",
                          code="invalid_type")
        if len(p) == 0:
            raise invalid(f"{where} must not be empty", param="prompt")
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
