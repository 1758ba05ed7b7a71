"""The router's OpenAI-compatible front door (FastAPI + httpx).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed SSE passed through as it
arrives), ``GET /v1/models``, ``/health``, ``/ready`` (a routing table is loaded) and ``/metrics``.

Per request: API key (401) and its rate limit (429 + ``Retry-After``); then the pipeline of
:mod:`.pipeline`: eligibility by the request's ``model`` (unknown: 404) and sticky key, the prompt
tokenized and hashed with that model version's tokenizer *off the event loop* (:class:`.prompt.PromptHasher`),
scoring against the prefix index (:mod:`.prefix_index`, fed by every replica's KV events), the PD
decision and admission. The plan's decode replica gets the request with headers ``X-Request-Id``,
``X-Ferry-Track``, ``X-Ferry-Model-Version``, ``X-Ferry-Decision`` and, for ``remote_prefill``,
``X-Ferry-Prefill-Endpoint`` (the plan's prefill replica; the decode worker performs the hand-off).
A connection error, timeout or 5xx *before the first byte of the answer* re-plans without the failed
replica and tries again (up to ``max_attempts``); once bytes have reached the client the stream is not
retried. The response carries ``X-Ferry-Replica``, ``X-Ferry-Track``, ``X-Ferry-Decision``,
``X-Ferry-Decision-Reason`` and the worker's ``X-Ferry-Cached-Tokens`` (streamed or not). The session (``X-Session-Id``, else the OpenAI ``user`` field, else
``X-Ferry-Sticky-Key``, which ``bench/workloads.py`` sends per session) breaks score ties and, without
``X-Ferry-Sticky-Key``, is the sticky key of the track split, so a session's turns stay on one model version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inference_worker import http_headers
from inference_worker.router.auth import ApiKeys
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
from inference_worker.router.source import QueueDepthScraper, TableSource
from inference_worker.router.table import DECODE_ROLES, Replica, RoutingTable

log = logging.getLogger(__name__)
PASS_HEADERS = ("content-type", "cache-control", http_headers.CACHED_TOKENS)


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

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


class Router:
    """State of one router process; ``self.app`` is the ASGI application."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None):
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.loads = LoadTracker()
        self.hasher = PromptHasher(config.tokenizer_dir)
        self.index = PrefixIndex()
        self.client: httpx.AsyncClient | None = None
        self.source: TableSource | None = None
        self.app = FastAPI(title="Ferry router", lifespan=self._lifespan)
        self.app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.app.add_api_route("/v1/chat/completions", self.completions, methods=["POST"])
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
        self.app.add_api_route("/ready", self.ready, methods=["GET"])
        self.app.add_api_route("/metrics", self.metrics_endpoint, methods=["GET"])

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI):
        c = self.config
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(c.request_timeout_s,
                                                                             connect=c.connect_timeout_s))
        self.source = TableSource(c.routing_table, client=self.client, metrics=self.metrics,
                                  service_token=c.service_token, interval_s=c.table_interval_s)
        await self.source.refresh()
        tasks = [asyncio.create_task(self.source.run())]
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

    async def ready(self) -> Response:
        if self.source is None or self.source.table is None:
            return _error(503, "no routing table loaded yet", "unavailable")
        return JSONResponse({"status": "ready", "routing_table_version": self.source.table.version})

    async def metrics_endpoint(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _check_key(self, request: Request) -> Response | None:
        keys = self.config.api_keys
        if keys is None:
            return None
        key = keys.authenticate(request.headers.get("authorization"))
        if key is None:
            return _error(401, "missing or unknown API key: send 'Authorization: Bearer <key>'", "authentication_error")
        retry_after = keys.retry_after_s(key)
        if retry_after:
            self.metrics.rate_limited.labels(key=key.name).inc()
            return _error(429, f"rate limit of key {key.name!r} exceeded; retry in {retry_after}s",
                          "rate_limit_error", headers={"Retry-After": str(retry_after)})
        return None

    async def completions(self, request: Request) -> Response:
        response = await self._completions(request)
        self.metrics.requests.labels(status=str(response.status_code)).inc()
        return response

    async def _completions(self, request: Request) -> Response:
        refused = self._check_key(request)
        if refused is not None:
            return refused
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return _error(400, f"invalid JSON body: {exc}", "invalid_request_error")
        table = self.source.table if self.source else None
        if table is None:
            return _error(503, "no routing table loaded yet", "unavailable")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        sticky = request.headers.get(http_headers.STICKY_KEY)
        session = request.headers.get("x-session-id") or body.get("user") or sticky
        session = session if isinstance(session, str) and session else None
        key = sticky or session or request_id
        model = body.get("model") if isinstance(body.get("model"), str) else None
        try:
            eligible = eligibility(table, model=model, sticky_key=key)
        except UnknownModel as exc:
            return _error(404, str(exc), "invalid_request_error")
        except NoReplicaAvailable as exc:
            return _error(503, str(exc), "unavailable")
        version = eligible.track.model_version
        hashing = self.config.policy == "cache_aware" and self.config.kv_index
        prompt = await asyncio.to_thread(self.hasher.info, version, table.model_info[version], request.url.path, body,
                                         hashing=hashing)
        headers = {"content-type": "application/json", "x-request-id": request_id,
                   http_headers.TRACK: eligible.track.name, http_headers.MODEL_VERSION: version}
        return await self._forward(request.url.path, raw, headers, table, eligible, prompt, session=session,
                                   model=model, key=key, stream=bool(body.get("stream")))

    async def models(self, request: Request) -> Response:
        refused = self._check_key(request)
        if refused is not None:
            return refused
        table = self.source.table if self.source else None
        if table is None:
            return _error(503, "no routing table loaded yet", "unavailable")
        names = models_served(table)
        if names:
            return JSONResponse({"object": "list", "data": [{"id": n, "object": "model", "created": 0,
                                                             "owned_by": "ferry"} for n in names]})
        for replica in (r for r in table.replicas if r.role in DECODE_ROLES):
            outcome = await self._attempt("GET", "/v1/models", None, {}, replica, None, False,
                                          httpx.Timeout(self.config.request_timeout_s,
                                                        connect=self.config.connect_timeout_s))
            if isinstance(outcome, Response):
                return outcome
        return _error(502, "no replica answered /v1/models", "upstream_error")

    def _plan(self, table: RoutingTable, eligible: Eligible, prompt: PromptInfo, session: str | None) -> RoutePlan:
        return plan_route(table, eligible=eligible, prompt=prompt, loads=self.loads,
                          index=self.index if self.config.kv_index else None, session=session,
                          policy=self.config.policy)

    async def _forward(self, path: str, content: bytes, headers: dict, table: RoutingTable, eligible: Eligible,
                       prompt: PromptInfo, *, session: str | None, model: str | None, key: str,
                       stream: bool) -> Response:
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
                            eligible = eligibility(table, model=model, sticky_key=key, exclude=frozenset(tried))
                        except NoReplicaAvailable:
                            break
                    plan = self._plan(table, eligible, prompt, session)
                    replica = plan.decode
                    if tried:
                        self.metrics.retries.labels(pool=replica.pool).inc()
                    else:
                        self.metrics.decisions.labels(pool=replica.pool, decision=plan.decision,
                                                      track=plan.track.name).inc()
                    self.metrics.decision_reasons.labels(pool=replica.pool, decision=plan.decision,
                                                         reason=plan.reason, cache=plan.cache).inc()
                    tried.add(replica.name)
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0 and not stream:
                        raise TimeoutError
                    timeout = httpx.Timeout(c.request_timeout_s if stream else remaining,
                                            connect=min(c.connect_timeout_s, max(remaining, 0.001)))
                    attempt_headers = {**headers, http_headers.DECISION: plan.decision}
                    if plan.prefill is not None:
                        attempt_headers[http_headers.PREFILL_ENDPOINT] = plan.prefill.url
                    admit(plan, self.loads)
                    outcome = await self._attempt("POST", path, content, attempt_headers, replica, plan, stream,
                                                  timeout, admitted=True)
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
                       admitted: bool = False) -> Response | tuple[str, int]:
        """One try on ``replica``: a Response to return, or (failure description, status to report if it is
        the last failure: 504 for a timeout, else 502). ``admitted``: :func:`admit` already booked it."""
        if self.client is None:
            raise RuntimeError("the router's HTTP client is created by the app lifespan; start the app first")
        if not admitted:
            self.loads.begin(replica)
        pending = plan.decode_prefill_tokens if admitted and plan is not None else 0
        released = False
        response = None
        try:
            upstream = self.client.build_request(method, replica.url + path, content=content, headers=headers,
                                                 timeout=timeout)
            response = await self.client.send(upstream, stream=True)
            if response.status_code >= 500:
                self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="status").inc()
                return f"{replica.name} answered {response.status_code}", 502
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
            self.loads.prefill_done(replica, pending)  # the first byte: the prompt is prefilled
            pending = 0
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
                return Response(body, response.status_code, headers=out_headers)
            released = True
            return StreamingResponse(self._relay(first, chunks, response, replica), response.status_code,
                                     headers=out_headers)
        except httpx.TimeoutException as exc:
            self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="timeout").inc()
            return f"{replica.name} timed out: {exc!r}", 504
        except httpx.TransportError as exc:
            self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="connect").inc()
            return f"{replica.name} unreachable: {exc!r}", 502
        finally:
            if pending:
                self.loads.prefill_done(replica, pending)
            if not released:
                self.loads.end(replica)
                if response is not None:
                    await response.aclose()

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], response: httpx.Response,
                     replica: Replica) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels(pool=replica.pool, replica=replica.name, kind="stream").inc()
            log.warning("stream from %s broke after the first byte: %s", replica.name, exc)
        finally:
            self.loads.end(replica)
            await response.aclose()
