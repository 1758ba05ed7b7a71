"""An httpx transport over one aiohttp session: the router's upstream calls with a C HTTP parser (torch-free).

The router speaks to its replicas through ``httpx.AsyncClient`` (its timeouts, exceptions and streaming
API; tests hand it a ``MockTransport`` or an ``ASGITransport``). httpx's default transport, httpcore,
parses HTTP/1.1 with the pure-Python ``h11`` on ``anyio``: on the router's request path that was the
largest share of its CPU per request. :class:`AiohttpTransport` sends the same requests through one
``aiohttp.ClientSession`` instead (llhttp, in C; one keep-alive connection pool for all replicas), and
maps aiohttp's outcomes onto the httpx exceptions the router already tells apart:

=============================================  ==========================  ======================
aiohttp                                        httpx                       router
=============================================  ==========================  ======================
``ConnectionTimeoutError`` (connect, pool)     ``ConnectTimeout``          timeout (504)
``SocketTimeoutError``, ``ServerTimeoutError``  ``ReadTimeout``             timeout (504)
``ClientConnectorError`` (refused, DNS)        ``ConnectError``            connect (502)
``ServerDisconnectedError``, ``ClientPayload   ``RemoteProtocolError``     connect (502), or a
Error`` (body cut short), ``ClientResponse                                 broken stream
Error`` (malformed answer)
``ClientOSError`` (reset), other               ``ReadError``               connect (502), or a
``ClientError``                                                            broken stream
=============================================  ==========================  ======================

(httpcore raised the same classes for the same events: a body cut short is a ``RemoteProtocolError``, "peer
closed connection without sending complete message body", which a broken stream's error event names.)

Timeouts come from each request's httpx ``timeout`` extension: ``connect`` bounds the TCP connect
(aiohttp ``sock_connect``), ``pool`` the wait for a pooled connection plus the connect (aiohttp
``connect``), ``read`` each read of the response, head or body (aiohttp ``sock_read``, renewed on every
chunk as httpx's read timeout is); ``write`` is not enforced (request bodies are at most the router's body
cap, written into the socket buffer). No total timeout: the router bounds whole requests itself.

Bodies are passed through untouched (no decompression, no redirects, no cookies kept: httpx's client does
cookies). A response stream closed before its end closes its connection, so the replica sees the hang-up
(the worker aborts the request, as it did with httpcore); a stream read to its end returns the connection
to the pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx
from yarl import URL

# Hop-by-hop and framing headers aiohttp sets itself from the body it sends.
_SKIP_HEADERS = frozenset({"transfer-encoding", "content-length", "connection", "keep-alive"})
# Headers aiohttp would add when httpx did not send them (a body without a type would become application/octet-stream).
_NO_AUTO_HEADERS = ("Content-Type", "User-Agent", "Accept", "Accept-Encoding")


def _as_httpx_error(exc: aiohttp.ClientError, request: httpx.Request) -> httpx.TransportError:
    """The httpx exception the router expects for ``exc`` (module docstring table)."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError):  # SocketTimeoutError and older read timeouts
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)


class _ResponseStream(httpx.AsyncByteStream):
    """An aiohttp response body as an httpx stream: chunks as they arrive; :meth:`aclose` releases the connection
    to the pool after a complete body, else closes it."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request):
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            raise _as_httpx_error(exc, self._request) from exc

    async def aclose(self) -> None:
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx transport on one aiohttp session (module docstring), created on first use on the running loop.

    Args:
        max_connections: connections open at once over all hosts (aiohttp ``limit``); more requests wait for
            one (bounded by the request's ``pool`` timeout).
        keepalive_s: how long an idle connection is kept for reuse.
    """

    def __init__(self, *, max_connections: int = 1000, keepalive_s: float = 15.0):
        self.max_connections, self.keepalive_s = max_connections, keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=max(self.max_connections, 0), limit_per_host=0,
                                             keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                                  timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _SKIP_HEADERS]
        try:
            data: bytes | httpx.AsyncByteStream | None = request.content or None
        except httpx.RequestNotRead:  # a streamed request body
            data = request.stream  # type: ignore[assignment]
        try:
            response = await self._get_session().request(
                request.method, URL(str(request.url), encoded=True), headers=headers, data=data,
                allow_redirects=False, skip_auto_headers=_NO_AUTO_HEADERS,
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout.get("pool"),
                                              sock_connect=timeout.get("connect"), sock_read=timeout.get("read")))
        except aiohttp.ClientError as exc:
            raise _as_httpx_error(exc, request) from exc
        return httpx.Response(response.status, headers=response.raw_headers,
                              stream=_ResponseStream(response, request), request=request,
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
