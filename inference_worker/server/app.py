"""FastAPI application of a worker: OpenAI routes, health, readiness and metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE streaming ending in
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (200 while the process and the engine
loop are alive, including while loading), ``GET /ready`` (200 only when loaded and not
draining, else 503), ``GET /metrics`` (Prometheus text from the worker's own registry). Disaggregation (:mod:`.pd`):
a prefill-role worker serves ``POST /internal/prefill``; a decode-role worker hands a request with
``X-Ferry-Prefill-Endpoint`` to that prefill worker. ``/health`` of both roles adds ``role``,
``model_version_id``, ``weights_sha256`` (the identity KV payloads must carry) and, on decode,
``kv_port`` (the KV receiver's TCP port).

Authentication (:mod:`.worker_auth`): with ``FERRY_WORKER_TOKEN`` set every route but ``/health``, ``/ready``
and ``/metrics`` needs ``Authorization: Bearer <the pool's worker token>`` (401 otherwise); ``/internal/prefill``
is authenticated by its link-secret signature instead.

Prefix cache (:mod:`.kv_cache_routes`): ``GET /v1/kv-events`` (NDJSON KV events) and ``POST
/admin/kv-cache/reset`` (the worker token; without one, signed with the link secret). Completions report reused prompt tokens (for a
remote prefill, those the prefill worker's cache spared it: see :mod:`.pd`) in
``usage.prompt_tokens_details.cached_tokens`` (the final streamed chunk too, with
``stream_options.include_usage``) and in the :data:`inference_worker.http_headers.CACHED_TOKENS` response header, sent with
the first byte: a streamed response starts once the engine has admitted the request.
With vLLM's ``return_token_ids`` option the responses also carry the prompt and generated token ids
(placement in :mod:`inference_worker.server.protocol`).

Every error is OpenAI error JSON (see :mod:`inference_worker.server.errors`). A client that
disconnects, streaming or not, has its engine requests aborted at once, which frees their KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_worker import http_headers, tracing
from inference_worker.request_limits import default_max_body_bytes, read_body_capped
from inference_worker.server.errors import OpenAIError, invalid
from inference_worker.server.kv_cache_routes import add_kv_cache_routes
from inference_worker.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    chat_sampling,
    completion_prompts,
    completion_sampling,
    parse_body,
)
from inference_worker.server.state import ServedModel, ServerState
from inference_worker.server.streaming import SSE_DONE, ChoiceEvent, Generation, GenerationError, sse
from inference_worker.server.worker_auth import WorkerAuthMiddleware
from inference_worker.tokenization import ChatTemplateError
from inference_worker.tracing import RequestSpan, Timeline

logger = logging.getLogger(__name__)

"""Response header: prompt tokens reused from the prefix cache (as ``usage.prompt_tokens_details.cached_tokens``)."""


def create_app(state: ServerState) -> FastAPI:
    """Build the app around a :class:`ServerState` (the model may still be loading)."""
    app = FastAPI(title="Ferry worker", docs_url=None, redoc_url=None)
    app.state.worker = state
    if state.worker_tokens is not None:  # every route but the probes needs the pool's token (:mod:`.worker_auth`)
        app.add_middleware(WorkerAuthMiddleware, tokens=state.worker_tokens)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing's own answers (404 unknown path, 405 wrong method) in OpenAI's error shape."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = OpenAIError(exc.status_code, str(exc.detail), code=code).response()
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.error("internal error", exc_info=exc)
        return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error",
                           code="internal_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.load_error is not None:
            return JSONResponse({"status": "error", "detail": state.load_error}, status_code=503)
        if state.loading:
            return JSONResponse({"status": "ok", "engine": "loading"})
        if not state.engine_alive:
            return JSONResponse({"status": "error", "detail": state.model.engine_loop.fatal_error},
                                status_code=503)
        body = {"status": "ok", "engine": "running"}
        if state.pd is not None:
            body.update(role=state.pd.settings.role, kv_port=state.pd.kv_port,
                        model_version_id=state.pd.settings.model_version_id,
                        weights_sha256=state.pd.weights_sha256)
        return JSONResponse(body)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        is_ready, reason = state.readiness()
        return JSONResponse({"ready": is_ready, "reason": reason}, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if torch.cuda.is_available():
            _update_gpu_metrics(state)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        # the context one request can really use: a KV cache smaller than max_model_len caps it
        max_len = state.model.context_len if state.model is not None else None
        card = {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "ferry",
                "max_model_len": max_len}
        return JSONResponse({"object": "list", "data": [card]})

    add_kv_cache_routes(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _traced(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _traced(state, request, chat=True)

    @app.get(tracing.SLOW_REQUESTS_PATH)
    async def slow_requests(limit: str | None = None) -> JSONResponse:
        """The slowest recent requests' phases (open like /metrics: timings, ids and counts, never prompt text)."""
        try:
            count = tracing.slow_limit(limit)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="limit") from None
        role = state.pd.settings.role if state.pd is not None else "colocated"
        return JSONResponse({"role": role, "capacity": state.slow.capacity, "requests": state.slow.slowest(count)})

    if state.pd is not None and state.pd.settings.role == "prefill":
        from inference_worker.server.pd import PREFILL_PATH, PrefillAbandoned, max_prefill_body_bytes

        @app.post(PREFILL_PATH)
        async def internal_prefill(request: Request) -> JSONResponse:
            """A decode worker's prefill request; counted by outcome like a completion, so a prefill pool's
            error rate (rollout gates, alerts) has data."""
            model = state.model
            if state.draining or model is None or not model.engine_loop.alive:
                state.metrics.request_finished("rejected")
                raise OpenAIError(503, f"the worker is not ready: {state.readiness()[1]}", type="server_error",
                                  code="not_ready")
            state.request_started()
            timeline = Timeline("prefill", "")
            span = RequestSpan("prefill.request", request.headers, timeline.start_ns)
            status = 500
            try:
                raw = await read_body_capped(request, max_prefill_body_bytes(model.max_model_len))
                watcher = asyncio.ensure_future(_wait_disconnect(request))
                try:  # a decode worker hanging up (its client left) aborts a prefill still computing
                    answer = await state.pd.handle_prefill(model, raw, request.headers, abandoned=watcher,
                                                           timeline=timeline)
                except PrefillAbandoned:
                    state.metrics.request_finished("aborted")
                    status = 499
                    return JSONResponse({}, status_code=499)
                finally:
                    watcher.cancel()
                status = 200
            except Exception as exc:
                status = exc.status_code if isinstance(exc, OpenAIError) else 500
                _count_failure(state, exc)
                raise
            finally:
                state.request_finished()
                _settle(state, timeline, span, status)
            state.metrics.request_finished("success")
            return JSONResponse(answer)

    return app


def _update_gpu_metrics(state: ServerState) -> None:
    free, total = torch.cuda.mem_get_info()
    try:
        utilization = torch.cuda.utilization() / 100.0
    except (ModuleNotFoundError, RuntimeError):  # needs NVML (pynvml), absent here: omit the figure
        utilization = None
    state.metrics.set_gpu(utilization=utilization, memory_used_bytes=total - free)


def _settle(state: ServerState, timeline: Timeline, span: RequestSpan, status: int) -> None:
    """End a request's timeline and span; keep it in the slow-request ring."""
    timeline.finish()
    timeline.attributes["status"] = status
    span.end_soon(timeline, error=None if status < 500 else f"status {status}")
    state.slow.record(timeline)


async def _traced(state: ServerState, request: Request, *, chat: bool) -> Response:
    """:func:`_serve` with the request's timeline and span (ended when the answer is complete, or a stream's
    last byte is sent)."""
    role = state.pd.settings.role if state.pd is not None else "colocated"
    timeline = Timeline(role, tracing.request_id(request.headers))
    span = RequestSpan("worker.request", request.headers, timeline.start_ns)
    status = 500
    try:
        response = await _serve(state, request, chat=chat, timeline=timeline, span=span)
        status = response.status_code
        if isinstance(response, _GenerationStream):
            response.settle = lambda: _settle(state, timeline, span, 200)
            status = 0
        return response
    except OpenAIError as exc:
        status = exc.status_code
        raise
    finally:
        if status:
            _settle(state, timeline, span, status)


def _count_failure(state: ServerState, exc: Exception) -> None:
    """Count a failed request's outcome: an OpenAI 4xx is ``client_error``, any other error ``server_error``."""
    client = isinstance(exc, OpenAIError) and exc.status_code < 500
    state.metrics.request_finished("client_error" if client else "server_error")


async def _serve(state: ServerState, request: Request, *, chat: bool, timeline: Timeline | None = None,
                 span: RequestSpan | None = None) -> Response:
    """Validate, admit and run one completion request; counts its outcome."""
    if state.draining:
        state.metrics.request_finished("rejected")
        raise OpenAIError(503, "the worker is draining (shutting down); retry on another replica",
                          type="server_error", code="draining")
    model = state.model
    if model is None or not model.engine_loop.alive:
        state.metrics.request_finished("rejected")
        raise OpenAIError(503, f"the worker is not ready: {state.readiness()[1]}", type="server_error",
                          code="not_ready")
    state.request_started()
    handed_over, generation = False, None
    try:
        max_body = state.max_body_bytes or default_max_body_bytes(model.max_model_len)
        raw = await read_body_capped(request, max_body)
        sampling, prompts = await asyncio.to_thread(_parse_and_tokenize, state, model, raw, chat=chat)
        generation = _prepare(state, model, sampling, prompts, chat=chat, headers=request.headers, timeline=timeline,
                              span=span)
        if timeline is not None:
            timeline.add("worker.parse", timeline.start_ns, time.time_ns(), num_prompts=len(prompts))
        if sampling.stream:
            # the cached-tokens header goes out with the first byte, once the engine admitted the request (for a
            # remote prefill: once the KV arrived); a client that leaves meanwhile aborts it (and the hand-off)
            admitted = asyncio.ensure_future(generation.wait_admitted())
            watcher = asyncio.ensure_future(_wait_disconnect(request))
            try:
                await asyncio.wait({admitted, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
            if not admitted.done():
                admitted.cancel()
                generation.abort()
                state.metrics.request_finished("aborted")
                return JSONResponse({}, status_code=499)
            admitted.result()
            try:
                generation.raise_early_error()  # a refused remote prefill keeps its 4xx status
            except GenerationError as exc:
                raise _generation_error(exc) from None
            handed_over = True
            return _GenerationStream(state, generation, sampling, chat=chat)
        return await _complete(state, request, generation, chat=chat, return_token_ids=sampling.return_token_ids)
    except Exception as exc:
        _count_failure(state, exc)
        raise
    finally:
        if not handed_over:
            if generation is not None:
                state.generations.discard(generation)
            state.request_finished()


def _parse_and_tokenize(state: ServerState, model: ServedModel, raw: bytes, *,
                        chat: bool) -> tuple[SamplingRequest, list[list[int]]]:
    """Validate the body and tokenize its prompts; runs in a worker thread (``asyncio.to_thread``).

    Tokenization uses ``Tokenizer.encode_batch``, which releases the GIL while it runs (``encode`` holds it
    for the whole call: measured here, a 1 MB prompt froze the event loop for about 3 s), so ``/health`` and
    other requests keep being served while a long prompt is tokenized.
    """
    body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
    if body.model != state.served_model_name:
        raise OpenAIError(404, f"model {body.model!r} does not exist; this worker serves "
                          f"{state.served_model_name!r} (see GET /v1/models)", param="model", code="model_not_found")
    if chat:
        sampling = chat_sampling(body)
        if model.chat_template is None:
            raise invalid(f"model {state.served_model_name!r} has no chat template; use /v1/completions",
                          param="messages", code="unsupported_model")
        try:
            text = model.chat_template.render(body.messages)
        except ChatTemplateError as exc:
            raise invalid(str(exc), param="messages") from None
        return sampling, [model.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids]
    sampling = completion_sampling(body)
    given = completion_prompts(body.prompt, state.max_prompts)
    texts = [p for p in given if isinstance(p, str)]
    encoded = iter(model.tokenizer.encode_batch(texts, add_special_tokens=True) if texts else [])
    prompts = []
    for prompt in given:
        if isinstance(prompt, str):
            prompts.append(next(encoded).ids)
        else:
            bad = [t for t in prompt if t >= model.vocab_size]
            if bad:
                raise invalid(f"token id {bad[0]} is out of range; the vocabulary has {model.vocab_size} tokens",
                              param="prompt")
            prompts.append(list(prompt))
    return sampling, prompts


def _prepare(state: ServerState, model: ServedModel, sampling: SamplingRequest, prompts: list[list[int]], *,
             chat: bool, headers=None, timeline: Timeline | None = None, span: RequestSpan | None = None) -> Generation:
    longest = max(len(p) for p in prompts)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = model.context_len - longest
        if max_tokens < 1:
            raise invalid(f"the prompt has {longest} tokens, which fills the context of {model.context_len}"
                          + ("" if model.context_len == model.max_model_len else " tokens that the KV cache holds"),
                          param="messages" if chat else "prompt", code="context_length_exceeded")
    elif longest + max_tokens > model.max_model_len:
        raise invalid(f"prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of "
                      f"{model.max_model_len} tokens; shorten the prompt or lower max_tokens",
                      param="max_tokens", code="context_length_exceeded")
    model.check_kv_capacity(longest, max_tokens, param="max_tokens")
    if state.should_inject_fault():
        raise OpenAIError(500, "injected fault (--fault-error-rate): this request failed on purpose",
                          type="server_error", code="injected_fault")

    def make_params(index: int):
        seed = None if sampling.seed is None else sampling.seed + index
        return model.make_sampling_params(
            max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            seed=seed, stop=list(sampling.stop), ignore_eos=sampling.ignore_eos,
        )

    prefix = "chatcmpl" if chat else "cmpl"
    remote_prefill = None
    prefill_url = (headers or {}).get(http_headers.PREFILL_ENDPOINT)
    if prefill_url and state.pd is not None and state.pd.settings.role == "decode":
        remote_prefill = state.pd.remote_prefill_for(prefill_url, headers, timeline=timeline, span=span)
    forwarded = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                 "seed": sampling.seed}
    generation = Generation(model.engine_loop, f"{prefix}-{uuid.uuid4().hex}", prompts, sampling.n, make_params,
                            state.metrics, remote_prefill=remote_prefill, sampling=forwarded, timeline=timeline,
                            traffic=http_headers.PROFILING not in (headers or {}))
    state.generations.add(generation)
    try:
        generation.start()
    except RuntimeError as exc:  # the engine loop stopped between the readiness check and now
        generation.abort()
        raise OpenAIError(503, f"the worker is not ready: {exc}", type="server_error", code="not_ready") from None
    return generation


async def _complete(state: ServerState, request: Request, generation: Generation, *, chat: bool,
                    return_token_ids: bool = False) -> JSONResponse:
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}

    async def collect() -> None:
        async for event in generation.events():
            texts.setdefault(event.index, []).append(event.text)
            token_ids.setdefault(event.index, []).extend(event.token_ids)
            if event.finish_reason is not None:
                reasons[event.index] = event.finish_reason

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():  # the client went away
            generation.abort()
            collector.cancel()
            state.metrics.request_finished("aborted")
            return JSONResponse({}, status_code=499)
        collector.result()
    except GenerationError as exc:
        raise _generation_error(exc) from None
    finally:
        watcher.cancel()
    choices = []
    for index in sorted(texts):
        text = "".join(texts[index])
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": reasons[index]})
        else:
            choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reasons[index]})
        if return_token_ids:  # vLLM's placement: completions choices carry their prompt, chat the response
            if not chat:
                choices[-1]["prompt_token_ids"] = generation.prompts[index // generation.n]
            choices[-1]["token_ids"] = token_ids[index]
    state.metrics.request_finished("success")
    body = {"id": generation.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": state.served_model_name, "choices": choices,
            "usage": generation.usage()}
    if return_token_ids and chat:
        body["prompt_token_ids"] = generation.prompts[0]
    return JSONResponse(body, headers={http_headers.CACHED_TOKENS: str(generation.num_cached_tokens)})


def _generation_error(exc: GenerationError) -> OpenAIError:
    """The OpenAI error of a failed generation: its status (400 for a refused prompt), type and code."""
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return OpenAIError(exc.status, str(exc), type=kind, code=exc.code)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _GenerationStream(StreamingResponse):
    """SSE response that always settles its request: abort if unfinished, count the outcome, leave in-flight.

    The settling runs after the ASGI call returns, also when the body iterator never started
    (client gone before the first byte) or was cancelled (client disconnected mid-stream).
    """

    def __init__(self, state: ServerState, generation: Generation, sampling: SamplingRequest, *, chat: bool):
        self.worker_state, self.generation, self.outcome = state, generation, "aborted"
        self.settle = None  # called once the stream is over (the request's timeline ends)
        super().__init__(self._body(sampling, chat), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", http_headers.CACHED_TOKENS: str(generation.num_cached_tokens)})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.generation.finished:
                self.generation.abort()
            self.worker_state.generations.discard(self.generation)
            self.worker_state.metrics.request_finished(self.outcome)
            self.worker_state.request_finished()
            if self.settle is not None:
                self.settle()

    async def _body(self, sampling: SamplingRequest, chat: bool) -> AsyncIterator[bytes]:
        generation, name = self.generation, self.worker_state.served_model_name
        created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

        with_ids, prompt_sent = sampling.return_token_ids, set()

        def chunk(choices: list[dict], usage: dict | None = None, prompt_token_ids: list[int] | None = None) -> bytes:
            data = {"id": generation.request_id, "object": obj, "created": created, "model": name, "choices": choices}
            if prompt_token_ids is not None:
                data["prompt_token_ids"] = prompt_token_ids
            if sampling.include_usage:
                data["usage"] = usage
            return sse(data)

        def choice(event: ChoiceEvent, *, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": event.text} if role else (
                    {"content": event.text} if event.text else {})
                out = {"index": event.index, "delta": delta, "logprobs": None, "finish_reason": event.finish_reason}
            else:
                out = {"index": event.index, "text": event.text, "logprobs": None, "finish_reason": event.finish_reason}
                if with_ids and event.index not in prompt_sent:  # a completion choice's first chunk
                    prompt_sent.add(event.index)
                    out["prompt_token_ids"] = generation.prompts[event.index // generation.n]
            if with_ids:
                out["token_ids"] = list(event.token_ids)
            return out

        if chat:  # OpenAI sends the role first, with empty content (and vLLM the prompt ids)
            num_choices = len(generation.prompts) * generation.n
            yield chunk([choice(ChoiceEvent(i, ""), role=True) for i in range(num_choices)],
                        prompt_token_ids=generation.prompts[0] if with_ids else None)
        try:
            async for event in generation.events():
                yield chunk([choice(event)])
        except GenerationError as exc:
            self.outcome = "client_error" if exc.status < 500 else "server_error"
            yield sse(_generation_error(exc).body())
            yield SSE_DONE
            return
        if sampling.include_usage:
            yield chunk([], generation.usage())
        yield SSE_DONE
        self.outcome = "success"
