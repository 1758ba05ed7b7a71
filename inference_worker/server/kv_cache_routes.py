"""Worker routes of the prefix cache: the KV events stream and the authenticated cache reset.

``GET /v1/kv-events?after=SEQ``: newline-delimited JSON batches of KV events (format, snapshots and
gaps in :mod:`inference_worker.server.kv_events`). ``POST /admin/kv-cache/reset``: forget every
cached KV block; answers ``{"cleared_blocks": n}``, 413 for a body over :data:`MAX_RESET_BODY_BYTES`
(refused before it is read). Authentication: on a worker with a worker token (``FERRY_WORKER_TOKEN``) both
routes need ``Authorization: Bearer <token>`` (:mod:`.worker_auth`, checked before the route runs) and nothing
else. A worker without one (a bare ``serve``, older deployments) takes the reset signed like
``/internal/prefill`` (HMAC-SHA256 of the raw body under the KV link secret in ``X-Ferry-KV-Signature``): 401
without a valid signature (:mod:`.signing`), 403 when it has no link secret either.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inference_worker import http_headers
from inference_worker.server.errors import OpenAIError, invalid
from inference_worker.server.kv_events import NDJSON, stream_kv_events
from inference_worker.server.signing import read_body_capped, verify_signature
from inference_worker.server.state import ServerState

KV_EVENTS_PATH = "/v1/kv-events"
RESET_PATH = "/admin/kv-cache/reset"
MAX_RESET_BODY_BYTES = 4096
"""The reset's body is only signed, not read (the README example signs ``{}``): 4 KiB is plenty."""
MAX_AFTER_DIGITS = 20
"""``after`` is a sequence number: 20 digits hold any 64-bit count."""
_DIGITS = re.compile(r"[0-9]+", re.ASCII)


def parse_after(raw: str | None) -> int | None:
    """The ``after`` query parameter: None when absent, else ASCII digits only (no sign, ``_`` or spaces).

    Raises:
        OpenAIError: 400 ``invalid_value`` (the value is quoted truncated to 32 characters).
    """
    if raw is None:
        return None
    if len(raw) > MAX_AFTER_DIGITS or _DIGITS.fullmatch(raw) is None:
        shown = raw if len(raw) <= 32 else raw[:32] + f"... ({len(raw)} chars)"
        raise invalid(f"after must be a sequence number of at most {MAX_AFTER_DIGITS} digits 0-9, got {shown!r}",
                      param="after")
    return int(raw)


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
        after = parse_after(request.query_params.get("after"))
        loop = _engine_loop(state)
        body = stream_kv_events(loop.kv_events, after, loop.kv_events_snapshot, request.is_disconnected)
        return StreamingResponse(body, media_type=NDJSON, headers={"Cache-Control": "no-cache"})

    @app.post(RESET_PATH)
    async def reset_kv_cache(request: Request) -> JSONResponse:
        secret = state.link_secret
        if state.worker_tokens is None and secret is None:
            raise OpenAIError(403, "this worker has neither a worker token (FERRY_WORKER_TOKEN) nor a KV link secret "
                              "(--kv-link-secret or FERRY_KV_LINK_SECRET) to authenticate the cache reset with",
                              type="permission_error", code="no_link_secret")
        raw = await read_body_capped(request, MAX_RESET_BODY_BYTES)
        if state.worker_tokens is None:  # with a token the middleware already checked it
            verify_signature(secret, raw, request.headers.get(http_headers.KV_SIGNATURE))
        cleared = await _engine_loop(state).reset_prefix_cache()
        return JSONResponse({"cleared_blocks": cleared})
