"""Worker routes of the prefix cache: the KV events stream and the authenticated cache reset.

``GET /v1/kv-events?after=SEQ``: newline-delimited JSON batches of KV events (format, snapshots and
gaps in :mod:`inference_worker.server.kv_events`). ``POST /admin/kv-cache/reset``: forget every
cached KV block; authenticated like ``/internal/prefill`` (HMAC-SHA256 of the raw body under the KV
link secret in ``X-Ferry-KV-Signature``) until workers get their own credential; answers
``{"cleared_blocks": n}``, 401 without a valid signature, 403 when the worker has no link secret.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inference_worker import http_headers
from inference_worker.server.errors import OpenAIError, invalid
from inference_worker.server.kv_events import NDJSON, stream_kv_events
from inference_worker.server.pd import sign
from inference_worker.server.state import ServerState

KV_EVENTS_PATH = "/v1/kv-events"
RESET_PATH = "/admin/kv-cache/reset"


def _engine_loop(state: ServerState):
    model = state.model
    if model is None or not model.engine_loop.alive:
        raise OpenAIError(503, f"the worker is not ready: {state.readiness()[1]}", type="server_error",
                          code="not_ready")
    return model.engine_loop


def add_kv_cache_routes(app: FastAPI, state: ServerState) -> None:
    """Register the KV events and cache-reset routes on ``app``."""

    @app.get(KV_EVENTS_PATH)
    async def kv_events(request: Request) -> StreamingResponse:
        raw = request.query_params.get("after")
        try:
            after = None if raw is None else int(raw)
        except ValueError:
            raise invalid(f"after must be an integer sequence number, got {raw!r}", param="after") from None
        if after is not None and after < 0:
            raise invalid(f"after must be >= 0, got {after}", param="after")
        loop = _engine_loop(state)
        body = stream_kv_events(loop.kv_events, after, loop.kv_events_snapshot, request.is_disconnected)
        return StreamingResponse(body, media_type=NDJSON, headers={"Cache-Control": "no-cache"})

    @app.post(RESET_PATH)
    async def reset_kv_cache(request: Request) -> JSONResponse:
        secret = state.link_secret
        if secret is None:
            raise OpenAIError(403, "this worker has no KV link secret (--kv-link-secret or FERRY_KV_LINK_SECRET); "
                              "the cache reset is signed with it", type="permission_error", code="no_link_secret")
        raw = await request.body()
        if not hmac.compare_digest(sign(secret, raw), request.headers.get(http_headers.KV_SIGNATURE, "")):
            raise OpenAIError(401, f"invalid or missing {http_headers.KV_SIGNATURE} (HMAC-SHA256 of the body under the link "
                              "secret)", type="authentication_error", code="invalid_signature")
        cleared = await _engine_loop(state).reset_prefix_cache()
        return JSONResponse({"cleared_blocks": cleared})
