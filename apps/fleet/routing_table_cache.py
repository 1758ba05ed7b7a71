"""The published routing table in Redis, keyed by its version, and the ASGI fast path that serves it.

Routers poll ``GET /api/v1/routing-table/`` every second each (``If-None-Match``: almost every answer is a
304). Through Django each poll costs a database read and the whole middleware/DRF path; a few hundred
routers are a few hundred of those per second. Instead:

* :func:`routing_table_cache_store` writes ``{version, etag, body}`` (the body exactly as the view renders it:
  DRF's ``JSONRenderer``) to one Redis hash after the table's transaction commits
  (:func:`apps.fleet.services.routing_table_publish`) and whenever the view serves the table. A Lua script
  writes only when the stored table was not published later (``published_at``: two publishers committing v5
  then v6 never leave v5 behind, and a new database whose version restarts at 1 still replaces an old
  entry); the key also expires after ``TTL_S``.
* :class:`RoutingTableFastPath` wraps the ASGI app: a GET of the routing table with the service token
  (``Authorization: Bearer <FERRY_SERVICE_TOKEN>``, constant-time compare) is answered from the hash — 304
  when ``If-None-Match`` holds its ETag, else 200 with the body — with one Redis round trip and no database
  access. Anything else (a user's token, a session, no cache entry, Redis down) goes to Django unchanged,
  which answers and refills the cache.

The links' measured load (telemetry's, :mod:`apps.telemetry.link_load`) is a second, small document beside the
table, ``GET /api/v1/link-load/``: the telemetry poller writes it every second (:func:`link_load_store`, with an
ETag of its content and a ``LINK_LOAD_TTL_S`` expiry, so a stopped poller's numbers vanish) and the same fast
path answers routers from it. It is not in the table because a value that changes every second would publish a
new table version every second and turn every router's 304 into a full table download; this document is a few
dozen bytes per link (routers: :class:`inference_worker.router.source.LinkLoadSource`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from datetime import datetime

import redis
import redis.asyncio as redis_async
from django.conf import settings
from rest_framework.renderers import JSONRenderer

logger = logging.getLogger(__name__)

KEY = "ferry:routing-table"
TTL_S = 60
PATH = "/api/v1/routing-table/"
LINK_LOAD_KEY = "ferry:link-load"
LINK_LOAD_PATH = "/api/v1/link-load/"
LINK_LOAD_TTL_S = 10
"""Seconds a link-load document outlives its last write (the poller writes one a second)."""
SERVED = {PATH: KEY, LINK_LOAD_PATH: LINK_LOAD_KEY}
"""Path -> Redis hash the fast path answers it from."""

# KEYS[1]: the hash; ARGV: published_at (epoch s), etag, body, ttl. Writes unless the stored table is newer.
_STORE_SCRIPT = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'published_at') or '0')
if stored > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'published_at', ARGV[1], 'etag', ARGV[2], 'body', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return 1
"""


def routing_table_etag(version: int, digest: str) -> str:
    """The table's strong ETag: ``"<version>-<first 16 hex of the content's sha256>"``."""
    return f'"{version}-{digest[:16]}"'


def routing_table_body(version: int, content: dict) -> bytes:
    """The JSON body the view answers with (``{"version": v, **content}``, DRF's renderer)."""
    return JSONRenderer().render({"version": version, **content})


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def routing_table_cache_store(*, version: int, digest: str, content: dict, published_at: datetime) -> bool:
    """Write the table to the cache unless one published later is there; True when written.

    A Redis error is logged and ignored (routers then get the table from Django): publishing never fails
    because of the cache.
    """
    try:
        with _client() as client:
            written = client.eval(_STORE_SCRIPT, 1, KEY, repr(published_at.timestamp()),
                                  routing_table_etag(version, digest),
                                  routing_table_body(version, content), TTL_S)
    except redis.RedisError as exc:
        logger.warning("routing table v%s not cached: %s", version, exc)
        return False
    return bool(written)


def link_load_body(document: dict) -> tuple[bytes, str]:
    """The link-load document's JSON body (DRF's renderer) and its strong ETag (``"<first 16 hex of its sha256>"``)."""
    body = JSONRenderer().render(document)
    return body, f'"{hashlib.sha256(body).hexdigest()[:16]}"'


def link_load_store(document: dict) -> bool:
    """Write the link-load document (``{"at", "window_s", "links": [...]}``, :mod:`apps.telemetry.link_load`) for
    ``LINK_LOAD_TTL_S`` seconds; True when written. A Redis error is logged and ignored (routers then keep their
    last measurement until it is stale, then route on the table's link values)."""
    body, etag = link_load_body(document)
    try:
        with _client() as client:
            client.pipeline().hset(LINK_LOAD_KEY, mapping={"etag": etag, "body": body}).expire(
                LINK_LOAD_KEY, LINK_LOAD_TTL_S).execute()
    except redis.RedisError as exc:
        logger.warning("link load not stored: %s", exc)
        return False
    return True


def link_load_read() -> bytes | None:
    """The stored link-load body, or None when none is current (no poller, expired)."""
    with _client() as client:
        return client.hget(LINK_LOAD_KEY, "body")


def routing_table_cache_clear() -> None:
    """Drop the cached table (tests; the next Django answer refills it)."""
    with _client() as client:
        client.delete(KEY, LINK_LOAD_KEY)


class RoutingTableFastPath:
    """ASGI middleware answering the service token's routing-table GETs from Redis (module docstring).

    ``app``: the ASGI application everything else goes to. One async Redis connection pool per process,
    created on first use (inside the server's event loop).
    """

    def __init__(self, app):  # noqa: ANN001 - any ASGI app
        self.app = app
        self._redis: redis_async.Redis | None = None
        self._token = settings.FERRY_SERVICE_TOKEN.encode()

    def _is_service_get(self, scope: dict) -> tuple[bool, bytes | None]:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD") or scope["path"] not in SERVED \
                or not self._token:
            return False, None
        authorization = if_none_match = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"if-none-match":
                if_none_match = value
        if authorization is None or not authorization[:7].lower() == b"bearer ":
            return False, None
        return hmac.compare_digest(authorization[7:].strip(), self._token), if_none_match

    async def __call__(self, scope, receive, send):  # noqa: ANN001 - ASGI signature
        served, if_none_match = self._is_service_get(scope)
        if served:
            served = await self._serve(scope, send, if_none_match)
        if not served:
            await self.app(scope, receive, send)

    async def _serve(self, scope: dict, send, if_none_match: bytes | None) -> bool:  # noqa: ANN001
        if self._redis is None:
            self._redis = redis_async.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        key = SERVED[scope["path"]]
        try:
            etag = await self._redis.hget(key, "etag")
            if etag is None:
                return False
            candidates = [tag.strip() for tag in (if_none_match or b"").split(b",")]
            not_modified = etag in candidates or b"*" in candidates
            body = b""
            if not not_modified:  # etag and body of one version
                etag, body = await self._redis.hmget(key, ["etag", "body"])
        except redis.RedisError as exc:
            logger.warning("routing table cache unavailable, serving through Django: %s", exc)
            return False
        if etag is None or body is None:  # expired between the two reads
            return False
        headers = [(b"etag", etag), (b"x-content-type-options", b"nosniff")]
        if not_modified:
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return True
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
        return True
