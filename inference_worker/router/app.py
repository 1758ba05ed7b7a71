"""The router's OpenAI-compatible front door (FastAPI/Starlette on uvicorn; httpx over aiohttp to the replicas).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed SSE passed through as it
arrives), ``GET /v1/models``, ``/health``, ``/ready`` (a routing table is loaded) and ``/metrics``.

Per request: API key (401; the configured keys plus the routing table's ``client_keys``, :mod:`.auth`), counted
per key name (``ferry_router_requests_by_key_total``), and its rate limit (429 + ``Retry-After``); a key limited to
some models gets 403 for another (``/v1/models`` lists only its models); an in-flight seat for the client and
overall (:mod:`.admission`: 429 / 503 + ``Retry-After``, decided before the body is read); the body read
with a cap (413, default sized for ``max_context_tokens``) and checked (:mod:`inference_worker.request_limits`:
400 for non-finite numbers, lone surrogates, deep nesting, ``n`` and ``prompt`` batches over their limits);
then the pipeline of
:mod:`.pipeline`: eligibility by the request's ``model`` (unknown: 404) and sticky key, the prompt
tokenized and hashed with that model version's tokenizer *off the event loop* (:class:`.prompt.PromptHasher`; a body
of at most :data:`INLINE_BODY_BYTES` is parsed, tokenized and hashed on the loop: cheaper than the hand-off),
scoring against the prefix index (:mod:`.prefix_index`, fed by every replica's KV events), the PD
decision and admission. The plan's decode replica gets the request with headers ``X-Request-Id``,
``X-Ferry-Track``, ``X-Ferry-Model-Version``, ``X-Ferry-Decision`` and, for ``remote_prefill``,
``X-Ferry-Prefill-Endpoint`` (the plan's prefill replica; the decode worker performs the hand-off).
Every call to a replica carries its pool's worker token from the routing table (``Authorization: Bearer``;
on a 401 the pool's previous token once, while a rotation rolls the replicas); a replica that still answers
401 refuses its pool's credential, which is the fleet's fault, not the client's: it counts as a failed attempt
(``kind="auth"``). A connection error, timeout or 5xx *before the first byte of the answer* re-plans without the failed
replica and tries again (up to ``max_attempts``); once bytes have reached the client the stream is not
retried. A 4xx from the worker (the client's error) is passed through as it is, never retried. Each attempt's
outcome feeds the circuit breaker (:mod:`.breaker`): a replica it ejected is left out at eligibility until
its cooldown ends and a probe succeeds; when that or failed attempts empty a track, the request goes to
another track of the model (``ferry_router_track_failovers_total``). A client that disconnects before its
answer is complete has its upstream request cancelled (the router closes that connection; the decode worker
aborts the request in its engine and, for a remote prefill, hangs up on the prefill worker, which aborts its
prefill): before the first byte the router watches the client while it waits, afterwards the streamed
response notices the disconnect. The response carries ``X-Ferry-Replica``, ``X-Ferry-Track``, ``X-Ferry-Decision``,
``X-Ferry-Decision-Reason`` and the worker's ``X-Ferry-Cached-Tokens`` (streamed or not). The session (``X-Session-Id``, else the OpenAI ``user`` field, else
``X-Ferry-Sticky-Key``, which ``bench/workloads.py`` sends per session) breaks score ties and, without
``X-Ferry-Sticky-Key``, is the sticky key of the track split, so a session's turns stay on one model version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inference_worker import http_headers, tracing
from inference_worker.request_limits import (
    DEFAULT_MAX_PROMPTS,
    check_request_size,
    default_max_body_bytes,
    parse_json_body,
    read_body_capped,
)
from inference_worker.router.admission import InFlightLimits
from inference_worker.router.auth import ApiKey, ApiKeys
from inference_worker.router.breaker import CLOSED, OPEN, BreakerConfig, CircuitBreaker, Transition
from inference_worker.router.decisions import LoadTracker, NoReplicaAvailable
from inference_worker.router.metrics import RouterMetrics
from inference_worker.router.pipeline import (
    POLICIES,
    Eligible,
    PromptInfo,
    RoutePlan,
    UnknownModel,
    admit,
    eligibility,
    models_served,
    plan_route,
)
from inference_worker.router.prefix_index import KVIndexFeed, PrefixIndex
from inference_worker.router.prompt import PromptHasher
from inference_worker.router.source import LinkLoadSource, QueueDepthScraper, TableSource, link_load_url
from inference_worker.router.table import DECODE_ROLES, Replica, RoutingTable
from inference_worker.router.transport import AiohttpTransport
from inference_worker.server.errors import OpenAIError
from inference_worker.tracing import RequestSpan, SlowRequests, Timeline

log = logging.getLogger(__name__)
PASS_HEADERS = ("content-type", "cache-control", http_headers.CACHED_TOKENS)
INLINE_BODY_BYTES = 2048
"""Bodies up to this size are parsed, tokenized and hashed on the event loop itself (once the model version's
tokenizer is loaded); larger ones on the prompt thread pool. Handing work to the pool and back costs the loop
more than that work for a short prompt (a ``serve_load`` prompt of ~300 bytes tokenizes in ~0.03 ms with Gemma 3's
tokenizer), while a 2 KiB body (~500 tokens) holds the loop for about 0.5 ms (a ~16 KB, 4K-token prompt: ~4.5 ms)."""


@dataclass
class RouterConfig:
    """Router settings."""

    routing_table: str
    """File path or control-plane URL of the routing table."""
    api_keys: ApiKeys | None = None
    """None: no authentication (development only)."""
    service_token: str | None = None
    tokenizer_dir: str | None = None
    table_interval_s: float = 1.0
    scrape_interval_s: float = 1.0
    """Queue-depth scrape period; 0 disables scraping (in-flight counts only)."""
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0
    """Bound on a whole non-streamed request, and on each read of a streamed one."""
    max_attempts: int = 3
    policy: str = "cache_aware"
    """Replica choice: cache_aware (prefix index + load), least_loaded or round_robin (benchmark references)."""
    kv_index: bool = True
    """Subscribe to the replicas' KV events and keep the prefix index (False: index off, for overhead runs)."""
    track: str | None = None
    """Pin to one track (``stable``, ``canary``...): serve only that track's replicas, whatever the table's
    weights; a Gateway API HTTPRoute splits traffic between per-track routers. None: split by the weights."""
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    """Circuit breaking thresholds (:mod:`.breaker`)."""
    max_context_tokens: int = 32768
    """The largest context of the models served (tokens; Gemma 3 270M's 32768): sizes the default body cap."""
    max_body_bytes: int | None = None
    """Request body cap, bytes (413 above); None: ``request_limits.default_max_body_bytes(max_context_tokens)``."""
    max_in_flight: int = 512
    """Requests in flight in all (503 + ``Retry-After`` above)."""
    max_in_flight_per_key: int = 64
    """Requests in flight per API key, or per client address without keys (429 + ``Retry-After`` above)."""
    max_prompts: int = DEFAULT_MAX_PROMPTS
    """Most prompts in one ``/v1/completions`` batch (400 above)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_body_bytes is None:
            self.max_body_bytes = default_max_body_bytes(self.max_context_tokens)
        if self.max_body_bytes < 1024 or self.max_prompts < 1:
            raise ValueError(f"max_body_bytes must be >= 1024 and max_prompts >= 1, got {self.max_body_bytes} "
                             f"and {self.max_prompts}")


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


class Router:
    """State of one router process; ``self.app`` is the ASGI application."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None):
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.loads = LoadTracker()
        self.seats = InFlightLimits(config.max_in_flight, config.max_in_flight_per_key)
        self.hasher = PromptHasher(config.tokenizer_dir)
        # Request bodies are parsed, tokenized and hashed on a bounded pool, never on the event loop: one thread
        # per core but one, so a burst of huge prompts leaves a core — and the GIL every switch interval — to
        # the loop that answers /health and streams (the default executor's cores + 4 threads would all contend).
        self.prompt_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="router-prompt")
        self.index = PrefixIndex()
        self.breaker = CircuitBreaker(config.breaker)
        self._breaker_table_version: int | None = None
        self._merged_keys: tuple[RoutingTable, ApiKeys] | None = None
        self.client: httpx.AsyncClient | None = None
        self.source: TableSource | None = None
        self.app = FastAPI(title="Ferry router", lifespan=self._lifespan)
        # plain Starlette routes (Request in, Response out): FastAPI's per-request dependency and body handling is
        # work these endpoints do not use (they read and check the body themselves)
        self.app.add_route("/v1/completions", self.completions, methods=["POST"])
        self.app.add_route("/v1/chat/completions", self.completions, methods=["POST"])
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
        self.app.add_api_route("/ready", self.ready, methods=["GET"])
        self.app.add_api_route("/metrics", self.metrics_endpoint, methods=["GET"])
        self.slow = SlowRequests()
        self.app.add_api_route(tracing.SLOW_REQUESTS_PATH, self.slow_requests, methods=["GET"])

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI):
        c = self.config
        # httpx's API (timeouts, exceptions, streams) over aiohttp's C HTTP parser and one keep-alive pool
        own_client = self.client = httpx.AsyncClient(
            transport=AiohttpTransport(max_connections=1000),
            timeout=httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s))
        self.source = TableSource(c.routing_table, client=self.client, metrics=self.metrics,
                                  service_token=c.service_token, interval_s=c.table_interval_s)
        await self.source.refresh()
        tasks = [asyncio.create_task(self.source.run())]
        if self.source.is_url:  # a file table carries its links' utilisation inline
            link_load = LinkLoadSource(self.source, client=self.client, url=link_load_url(c.routing_table),
                                       service_token=c.service_token, interval_s=c.table_interval_s)
            tasks.append(asyncio.create_task(link_load.run()))
        if c.scrape_interval_s > 0:
            scraper = QueueDepthScraper(self.source, self.loads, client=self.client, interval_s=c.scrape_interval_s)
            tasks.append(asyncio.create_task(scraper.run()))
        if c.kv_index and c.policy == "cache_aware":
            feed = KVIndexFeed(self.index, self.source, client=self.client, interval_s=c.table_interval_s,
                               on_resync=lambda name: self.metrics.index_resyncs.labels(replica=name).inc())
            tasks.append(asyncio.create_task(feed.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.aclose()
            if own_client is not self.client:  # a test swapped in its own client: close ours too
                await own_client.aclose()

    async def ready(self) -> Response:
        if self.source is None or self.source.table is None:
            return _error(503, "no routing table loaded yet", "unavailable")
        return JSONResponse({"status": "ready", "routing_table_version": self.source.table.version})

    async def metrics_endpoint(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _keys(self) -> ApiKeys | None:
        """The keys in force: the configured ones (file or environment) plus the current routing table's
        ``client_keys`` (rebuilt when the table changes, buckets kept); None without authentication."""
        static = self.config.api_keys
        table = self.source.table if self.source else None
        if static is None or table is None or table.client_keys is None:
            return static
        if self._merged_keys is None or self._merged_keys[0] is not table:
            previous = self._merged_keys[1] if self._merged_keys else None
            self._merged_keys = (table, static.with_table_keys(table.client_keys, previous=previous))
        return self._merged_keys[1]

    async def slow_requests(self, request: Request) -> Response:
        """``GET /debug/slow-requests?limit=N``: the slowest recent requests' phases (open like /metrics: timings,
        ids and counts, no prompt text); 400 for a bad ``limit``."""
        try:
            limit = tracing.slow_limit(request.query_params.get("limit"))
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        return JSONResponse({"role": "router", "capacity": self.slow.capacity, "requests": self.slow.slowest(limit)})

    def _check_key(self, request: Request) -> Response | ApiKey | None:
        """A refusal (401, 429), the client's key, or None without keys configured."""
        keys = self._keys()
        if keys is None:
            return None
        key = keys.authenticate(request.headers.get("authorization"))
        if key is None:
            return _error(401, "missing or unknown API key: send 'Authorization: Bearer <key>'", "authentication_error")
        self.metrics.requests_by_key.labels(key=key.name).inc()
        retry_after = keys.retry_after_s(key)
        if retry_after:
            self.metrics.rate_limited.labels(key=key.name).inc()
            return _error(429, f"rate limit of key {key.name!r} exceeded; retry in {retry_after}s",
                          "rate_limit_error", headers={"Retry-After": str(retry_after)})
        return key

    async def completions(self, request: Request) -> Response:
        timeline = Timeline("router", tracing.request_id(request.headers))
        span = RequestSpan("router.request", request.headers, timeline.start_ns)
        response = await self._seated(request, timeline, span)
        self.metrics.requests.labels(status=str(response.status_code)).inc()
        if not isinstance(response, _SettledStream):  # a stream's timeline ends with its last byte
            self._finish(timeline, span, response.status_code)
        return response

    def _finish(self, timeline: Timeline, span: RequestSpan, status: int) -> None:
        """End ``timeline`` (and its span); keep it in the slow-request ring when the request was admitted (it has
        phases: past the key check, the seat and the body checks). Refusals (401, 429, 413, a malformed body) are
        not kept: the endpoint is open, and anyone without a key could otherwise push every admitted request's
        timeline out of the ring."""
        timeline.finish()
        timeline.attributes["status"] = status
        if timeline.phases and timeline.phases[-1].name == "router.relay":
            timeline.phases[-1].end_ns = timeline.end_ns
        span.end_soon(timeline, error=None if status < 500 else f"status {status}")
        if timeline.phases:
            self.slow.record(timeline)

    async def _seated(self, request: Request, timeline: Timeline, span: RequestSpan) -> Response:
        """Key, then an in-flight seat held until the answer is sent (:mod:`.admission`), then the request."""
        key = self._check_key(request)
        if isinstance(key, Response):
            return key
        client = f"key:{key.name}" if key is not None else f"addr:{request.client.host if request.client else '-'}"
        refusal = self.seats.enter(client)
        if refusal is not None:
            self.metrics.admission_refused.labels(reason=refusal.reason).inc()
            kind = "rate_limit_error" if refusal.status == 429 else "unavailable"
            return _error(refusal.status, refusal.message, kind, headers={"Retry-After": str(refusal.retry_after_s)})
        self.metrics.in_flight.inc()

        def leave() -> None:
            self.seats.leave(client)
            self.metrics.in_flight.dec()

        handed_over = False
        try:
            try:
                response = await self._completions(request, timeline, span, key)
            except OpenAIError as exc:
                return exc.response()
            if isinstance(response, StreamingResponse):
                handed_over = True

                def settle() -> None:
                    leave()
                    self._finish(timeline, span, response.status_code)

                return _SettledStream(response, settle)
            return response
        finally:
            if not handed_over:
                leave()

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` on :attr:`prompt_executor` (JSON parsing, tokenizing, hashing: CPU work of one request)."""
        return await asyncio.get_running_loop().run_in_executor(self.prompt_executor, fn, *args)

    async def _completions(self, request: Request, timeline: Timeline, span: RequestSpan,
                           api_key: ApiKey | None = None) -> Response:
        """Raises OpenAIError (413, 400) for a body over the cap or malformed (module docstring); 403 when
        ``api_key`` may not use the requested model."""
        raw = await read_body_capped(request, self.config.max_body_bytes)
        inline = len(raw) <= INLINE_BODY_BYTES
        body = parse_json_body(raw) if inline else await self._off_loop(parse_json_body, raw)
        check_request_size(body, max_prompts=self.config.max_prompts)
        route_start_ns = time.time_ns()
        timeline.add("router.admit", timeline.start_ns, route_start_ns, body_bytes=len(raw))
        table = self.source.table if self.source else None
        if table is None:
            return _error(503, "no routing table loaded yet", "unavailable")
        request_id = timeline.request_id
        sticky = request.headers.get(http_headers.STICKY_KEY)
        session = request.headers.get("x-session-id") or body.get("user") or sticky
        session = session if isinstance(session, str) and session else None
        key = sticky or session or request_id
        model = body.get("model") if isinstance(body.get("model"), str) else None
        if api_key is not None and not api_key.allows(model):
            return _error(403, f"API key {api_key.name!r} may use only the models {sorted(api_key.models)}; name one in "
                               "'model'", "permission_error")
        try:
            eligible = self._eligibility(table, model=model, sticky_key=key)
        except UnknownModel as exc:
            return _error(404, str(exc), "invalid_request_error")
        except NoReplicaAvailable as exc:
            return _error(503, str(exc), "unavailable")
        version = eligible.track.model_version
        hashing = self.config.policy == "cache_aware" and self.config.kv_index
        work = functools.partial(self.hasher.info, version, table.model_info[version], request.url.path, body,
                                 hashing=hashing)
        prompt = work() if inline and self.hasher.loaded(version, table.model_info[version]) else \
            await self._off_loop(work)
        headers = {"content-type": "application/json", "x-request-id": request_id,
                   http_headers.TRACK: eligible.track.name, http_headers.MODEL_VERSION: version}
        span.inject(headers)
        forward = asyncio.ensure_future(self._forward(request.url.path, raw, headers, table, eligible, prompt,
                                                      session=session, model=model, key=key,
                                                      stream=bool(body.get("stream")), timeline=timeline,
                                                      route_start_ns=route_start_ns))
        return await self._unless_client_leaves(request, forward)

    async def _unless_client_leaves(self, request: Request, forward: asyncio.Future) -> Response:
        """``forward``'s response, or 499 after cancelling it when the client disconnects first (the cancelled
        upstream request's connection is closed, which the worker takes as an abort)."""
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({forward, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if forward.done():
            return forward.result()
        forward.cancel()
        await asyncio.gather(forward, return_exceptions=True)
        self.metrics.client_disconnects.inc()
        return _error(499, "the client closed the connection before the answer was complete", "client_closed")

    async def models(self, request: Request) -> Response:
        refused = self._check_key(request)
        if isinstance(refused, Response):
            return refused
        table = self.source.table if self.source else None
        if table is None:
            return _error(503, "no routing table loaded yet", "unavailable")
        names = models_served(table)
        restricted = isinstance(refused, ApiKey) and refused.models is not None
        if restricted:
            names = [n for n in names if n in refused.models]
        if names or restricted:
            return JSONResponse({"object": "list", "data": [{"id": n, "object": "model", "created": 0,
                                                             "owned_by": "ferry"} for n in names]})
        for replica in (r for r in table.replicas if r.role in DECODE_ROLES):
            outcome = await self._attempt("GET", "/v1/models", None, {}, replica, None, False,
                                          httpx.Timeout(self.config.request_timeout_s,
                                                        connect=self.config.connect_timeout_s))
            if isinstance(outcome, Response):
                return outcome
        return _error(502, "no replica answered /v1/models", "upstream_error")

    def _eligibility(self, table: RoutingTable, *, model: str | None, sticky_key: str,
                     exclude: frozenset[str] = frozenset()) -> Eligible:
        """Pipeline step 1 without the replicas the breaker ejected; counts a track failover."""
        if table.version != self._breaker_table_version:  # one 0/1 series per replica, so 0 is data for gates
            self.breaker.forget({r.name for r in table.replicas})
            self._breaker_table_version = table.version
            ejected_now = {r.name for r in table.replicas if self.breaker.state(r.name) != CLOSED}
            self.metrics.replica_ejected.clear()
            for r in table.replicas:
                self.metrics.replica_ejected.labels(pool=r.pool, track=r.track, replica=r.name).set(
                    1 if r.name in ejected_now else 0)
        eligible = eligibility(table, model=model, sticky_key=sticky_key, exclude=exclude,
                               ejected=self.breaker.ejected(), track=self.config.track)
        if eligible.failover_from is not None:
            self.metrics.track_failovers.labels(from_track=eligible.failover_from, to_track=eligible.track.name).inc()
        return eligible

    def _breaker_outcome(self, replica: Replica, ok: bool) -> None:
        """Tell the breaker an attempt's outcome; an ejection or a restore updates the metrics."""
        change: Transition | None = self.breaker.record(replica.name, ok)
        if change is None:
            return
        ejected = change.state == OPEN
        labels = dict(pool=replica.pool, track=replica.track, replica=replica.name)
        self.metrics.replica_ejected.labels(**labels).set(1 if ejected else 0)
        if ejected:
            self.metrics.ejections.labels(**labels, reason=change.reason).inc()
            log.warning("ejected replica %s (%s: %d of %d failed)", replica.name, change.reason, change.failures,
                        change.requests)
        else:
            log.info("replica %s restored after a successful probe", replica.name)

    def _plan(self, table: RoutingTable, eligible: Eligible, prompt: PromptInfo, session: str | None) -> RoutePlan:
        return plan_route(table, eligible=eligible, prompt=prompt, loads=self.loads,
                          index=self.index if self.config.kv_index else None, session=session,
                          policy=self.config.policy)

    async def _forward(self, path: str, content: bytes, headers: dict, table: RoutingTable, eligible: Eligible,
                       prompt: PromptInfo, *, session: str | None, model: str | None, key: str,
                       stream: bool, timeline: Timeline | None = None, route_start_ns: int = 0) -> Response:
        tried: set[str] = set()
        last_error, status = "no replica available", 502
        c = self.config
        deadline = asyncio.get_running_loop().time() + c.request_timeout_s
        try:
            # Each attempt gets the remaining budget as its httpx timeout (so a slow replica is counted as
            # an upstream timeout); this outer bound is a backstop for non-streamed requests.
            async with asyncio.timeout(None if stream else c.request_timeout_s + 1.0):
                while len(tried) < self.config.max_attempts:
                    if tried:  # re-plan without the replicas that failed
                        try:
                            eligible = self._eligibility(table, model=model, sticky_key=key, exclude=frozenset(tried))
                        except NoReplicaAvailable:
                            break
                    plan = self._plan(table, eligible, prompt, session)
                    replica = plan.decode
                    if timeline is not None:
                        timeline.add("router.route", route_start_ns or timeline.start_ns, time.time_ns(),
                                     attempt=len(tried) + 1, decision=plan.decision, reason=plan.reason,
                                     decode_replica=replica.name, prefill_replica=plan.prefill.name if plan.prefill
                                     else "", predicted_cached_tokens=plan.predicted_cached_tokens,
                                     num_prompt_tokens=plan.num_prompt_tokens)
                        timeline.attributes.update(pool=replica.pool, decode_replica=replica.name,
                                                   decision=plan.decision, track=plan.track.name,
                                                   prefill_replica=plan.prefill.name if plan.prefill else "")
                        route_start_ns = 0
                    if tried:
                        self.metrics.retries.labels(pool=replica.pool).inc()
                    else:
                        self.metrics.decisions.labels(pool=replica.pool, decision=plan.decision,
                                                      track=plan.track.name).inc()
                    self.metrics.decision_reasons.labels(pool=replica.pool, decision=plan.decision,
                                                         reason=plan.reason, cache=plan.cache).inc()
                    if plan.threshold_tokens is not None:
                        self.metrics.effective_threshold.labels(pool=replica.pool, model_version=replica.model_version
                                                                ).set(plan.threshold_tokens)
                    tried.add(replica.name)
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0 and not stream:
                        raise TimeoutError
                    timeout = httpx.Timeout(c.request_timeout_s if stream else remaining,
                                            connect=min(c.connect_timeout_s, max(remaining, 0.001)))
                    attempt_headers = {**headers, http_headers.DECISION: plan.decision,  # the track may have failed over
                                       http_headers.TRACK: plan.track.name,
                                       http_headers.MODEL_VERSION: plan.track.model_version}
                    if plan.prefill is not None:
                        attempt_headers[http_headers.PREFILL_ENDPOINT] = plan.prefill.url
                    admit(plan, self.loads)
                    outcome = await self._attempt("POST", path, content, attempt_headers, replica, plan, stream,
                                                  timeout, admitted=True, timeline=timeline)
                    if isinstance(outcome, Response):
                        return outcome
                    last_error, status = outcome
        except TimeoutError:
            return _error(504, f"request timed out after {self.config.request_timeout_s}s", "timeout")
        kind = "timeout" if status == 504 else "upstream_error"
        return _error(status, f"no replica answered ({len(tried)} tried): {last_error}", kind)

    def _observe_cached(self, plan: RoutePlan, response: httpx.Response) -> None:
        """Index accuracy: the plan's prediction against the worker's ``X-Ferry-Cached-Tokens``."""
        reported = response.headers.get(http_headers.CACHED_TOKENS)
        if plan.cache != "on" or reported is None or not reported.isdigit():
            return
        pool = plan.decode.pool
        self.metrics.predicted_cached.labels(pool=pool).inc(plan.predicted_cached_tokens)
        self.metrics.reported_cached.labels(pool=pool).inc(int(reported))
        self.metrics.cached_error.labels(pool=pool).observe(plan.predicted_cached_tokens - int(reported))

    async def _attempt(self, method: str, path: str, content: bytes | None, headers: dict, replica: Replica,
                       plan: RoutePlan | None, stream: bool, timeout: httpx.Timeout,
                       admitted: bool = False, timeline: Timeline | None = None) -> Response | tuple[str, int]:
        """One try on ``replica``: a Response to return, or (failure description, status to report if it is
        the last failure: 504 for a timeout, else 502). ``admitted``: :func:`admit` already booked it."""
        if self.client is None:
            raise RuntimeError("the router's HTTP client is created by the app lifespan; start the app first")
        if not admitted:
            self.loads.begin(replica)
        pending = plan.decode_prefill_tokens if admitted and plan is not None else 0
        before_first_byte = True  # prefill_done once per begin: at the first byte or when the attempt ends
        released = False
        judged = plan is None  # only planned attempts feed the breaker
        if not judged:
            self.breaker.attempt(replica.name)
        response = None
        sent_ns = time.time_ns()
        try:
            upstream = self.client.build_request(method, replica.url + path, content=content,
                                                 headers={**headers, **replica.auth_headers}, timeout=timeout)
            response = await self.client.send(upstream, stream=True)
            if response.status_code == 401 and replica.worker_token_previous:
                # a rotation is rolling the pool: this replica still knows only the token before it
                await response.aclose()
                previous = {**headers, "Authorization": f"Bearer {replica.worker_token_previous}"}
                upstream = self.client.build_request(method, replica.url + path, content=content, headers=previous,
                                                     timeout=timeout)
                response = await self.client.send(upstream, stream=True)
            if response.status_code == 401:  # the replica refuses its pool's token: a fleet fault, not the client's
                self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="auth").inc()
                judged = True
                self._breaker_outcome(replica, False)
                log.warning("replica %s refused its pool's worker token (401)", replica.name)
                return f"{replica.name} refused the pool's worker token (401)", 502
            if response.status_code >= 500:
                self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="status").inc()
                judged = True
                self._breaker_outcome(replica, False)
                return f"{replica.name} answered {response.status_code}", 502
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
            self.loads.prefill_done(replica, pending)  # the first byte: the prompt is prefilled
            if timeline is not None:
                first_ns = time.time_ns()
                cached = response.headers.get(http_headers.CACHED_TOKENS, "")
                timeline.add("router.upstream", sent_ns, first_ns, replica=replica.name, status=response.status_code)
                timeline.add("router.relay", first_ns, first_ns)  # ends with the answer's last byte (_finish)
                if cached.isdigit():
                    timeline.attributes["cached_tokens"] = int(cached)
            before_first_byte = False
            out_headers = {k: v for k, v in response.headers.items() if k.lower() in PASS_HEADERS}
            out_headers[http_headers.REPLICA] = replica.name
            if http_headers.CACHED_TOKENS in response.headers:
                out_headers[http_headers.CACHED_TOKENS] = response.headers[http_headers.CACHED_TOKENS]
            if plan is not None:
                self._observe_cached(plan, response)
                out_headers.update({http_headers.TRACK: plan.track.name, http_headers.DECISION: plan.decision,
                                    http_headers.DECISION_REASON: plan.reason,
                                    "x-request-id": headers.get("x-request-id", "")})
            if not stream:
                body = first + b"".join([c async for c in chunks])
                judged = True
                self._breaker_outcome(replica, True)  # a 4xx is the client's error, not the replica's
                return Response(body, response.status_code, headers=out_headers)
            released = judged = True  # the relay judges the stream when it ends
            return StreamingResponse(self._relay(first, chunks, response, replica, plan is not None),
                                     response.status_code, headers=out_headers)
        except httpx.TimeoutException as exc:
            self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="timeout").inc()
            judged = True
            self._breaker_outcome(replica, False)
            return f"{replica.name} timed out: {exc!r}", 504
        except httpx.TransportError as exc:
            self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="connect").inc()
            judged = True
            self._breaker_outcome(replica, False)
            return f"{replica.name} unreachable: {exc!r}", 502
        finally:
            if not judged:  # cancelled (the client went away): no outcome, a probe may go again
                self.breaker.release(replica.name)
            if before_first_byte:
                self.loads.prefill_done(replica, pending)
            if not released:
                self.loads.end(replica)
                if response is not None:
                    await response.aclose()

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], response: httpx.Response,
                     replica: Replica, judge: bool = True) -> AsyncIterator[bytes]:
        """Pass a streamed answer through. An SSE answer (``text/event-stream``) goes out whole events at a
        time (up to its last ``\\n\\n``), so when the upstream breaks mid-stream (its worker killed) the client
        never gets a cut event: the incomplete one is dropped and the stream ends with an OpenAI error event
        (type ``server_error``, code ``upstream_stream_broken``) and ``data: [DONE]``, as a worker ends a
        failed generation. Nothing is retried once bytes reached the client."""
        event_stream = response.headers.get("content-type", "").startswith("text/event-stream")
        held = b""  # an SSE event not complete yet
        ok = None
        try:
            async for chunk in _prepend(first, chunks):
                if not event_stream:
                    yield chunk
                    continue
                held += chunk
                end = held.rfind(b"\n\n") + 2
                if end >= 2:
                    out, held = held[:end], held[end:]
                    yield out
            if held:
                yield held
            ok = True
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="stream").inc()
            log.warning("stream from %s broke after the first byte: %s", replica.name, exc)
            ok = False
            if event_stream:
                yield broken_stream_event(replica.name, exc)
        finally:
            if judge:
                if ok is None:  # the client went away mid-stream: no outcome for the replica
                    self.breaker.release(replica.name)
                else:
                    self._breaker_outcome(replica, ok)
            self.loads.end(replica)
            await response.aclose()


async def _prepend(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in chunks:
        yield chunk


def broken_stream_event(replica_name: str, exc: Exception) -> bytes:
    """The SSE bytes that end a stream whose upstream broke: an OpenAI error event, then ``data: [DONE]``."""
    error = OpenAIError(502, f"the answer from replica {replica_name} broke off mid-stream ({type(exc).__name__}); "
                             "the tokens sent so far are incomplete: send the request again",
                        type="server_error", code="upstream_stream_broken")
    return b"data: " + json.dumps(error.body(), separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (call only after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SettledStream(Response):
    """A streamed answer that runs ``settle`` once it is over: finished, failed, or the client gone (also when
    the body never started), so an in-flight seat is always given back."""

    def __init__(self, inner: StreamingResponse, settle):
        self.inner, self.settle = inner, settle
        self.status_code = inner.status_code
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.settle()
