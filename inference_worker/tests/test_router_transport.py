"""The router's httpx transport over aiohttp (:mod:`inference_worker.router.transport`) against raw asyncio HTTP
servers: what it sends and returns, and every failure as the httpx exception the router tells apart (timeouts
answer 504; refused, dropped and broken connections 502; a broken stream ends with an error event)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from inference_worker import http_headers
from inference_worker.router.transport import AiohttpTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """(request line, headers with lower-case names, body by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *fields = head[:-4].split(b"\r\n")
    headers = {}
    for f in fields:
        name, value = f.decode().split(":", 1)
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return line, headers, body


def run(handler: Handler, client_code: Callable[[httpx.AsyncClient, str], Awaitable]):
    """Serve ``handler`` on a free loopback port and run ``client_code(client, base_url)`` with a client on the
    transport; returns its result."""

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = httpx.AsyncClient(transport=AiohttpTransport(), timeout=httpx.Timeout(5.0, connect=2.0))
        try:
            return await client_code(client, f"http://127.0.0.1:{port}")
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(main())


def response(status: int, body: bytes, *headers: str) -> bytes:
    extra = "".join(h + "\r\n" for h in headers)
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_a_request_and_its_answer_pass_through_unchanged():
    seen = []

    async def handler(reader, writer):
        seen.append(await read_request(reader))
        # a gzip content-encoding is not decoded: the router relays the raw bytes
        writer.write(response(201, b"\x1f\x8braw", f"{http_headers.CACHED_TOKENS}: 32", "Set-Cookie: a=1",
                              "Content-Encoding: gzip", "X-Multi: 1", "X-Multi: 2"))
        await writer.drain()
        writer.close()

    async def client_code(client, url):
        async with client.stream("POST", url + "/v1/completions?after=7", content=b'{"prompt": "hi"}',
                                 headers={"Authorization": "Bearer tok", "X-Request-Id": "rid-1",
                                          "Content-Type": "application/json"}) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])  # as the router relays it
        return r.status_code, r.headers[http_headers.CACHED_TOKENS], r.headers.get_list("x-multi"), raw

    assert run(handler, client_code) == (201, "32", ["1", "2"], b"\x1f\x8braw")
    line, headers, body = seen[0]
    assert line == b"POST /v1/completions?after=7 HTTP/1.1"
    assert body == b'{"prompt": "hi"}' and headers["content-length"] == "16"
    assert (headers["authorization"], headers["x-request-id"]) == ("Bearer tok", "rid-1")
    assert headers["host"].startswith("127.0.0.1:") and "transfer-encoding" not in headers
    assert headers["content-type"] == "application/json" and headers["user-agent"].startswith("python-httpx/")


def test_a_body_without_a_content_type_is_sent_without_one():
    seen = []

    async def handler(reader, writer):
        seen.append(await read_request(reader))
        writer.write(response(200, b""))
        await writer.drain()
        writer.close()

    async def client_code(client, url):
        return (await client.post(url + "/reset", content=b"x")).status_code

    assert run(handler, client_code) == 200
    assert "content-type" not in seen[0][1] and seen[0][2] == b"x"


def test_a_refused_connection_is_a_connect_error():
    async def client_code(client, url):
        await client.get("http://127.0.0.1:1/v1/models")

    with pytest.raises(httpx.ConnectError):
        run(lambda r, w: None, client_code)


def test_no_answer_within_the_read_timeout_is_a_read_timeout():
    async def handler(reader, writer):
        await read_request(reader)
        await asyncio.sleep(3)
        writer.close()

    async def client_code(client, url):
        await client.get(url + "/slow", timeout=httpx.Timeout(0.3, connect=1.0))

    with pytest.raises(httpx.ReadTimeout):
        run(handler, client_code)


def test_a_connection_closed_before_the_answer_is_a_protocol_error_not_a_timeout():
    async def handler(reader, writer):
        await read_request(reader)
        writer.close()

    async def client_code(client, url):
        await client.get(url + "/")

    with pytest.raises(httpx.RemoteProtocolError):
        run(handler, client_code)


def test_a_body_cut_short_raises_a_protocol_error_while_streaming():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ndata: 1\n\n")
        await writer.drain()
        writer.close()

    async def client_code(client, url):
        got = []
        async with client.stream("GET", url + "/") as r:
            with pytest.raises(httpx.RemoteProtocolError):  # as httpcore: the router's relay names it
                async for chunk in r.aiter_raw():
                    got.append(chunk)
        return b"".join(got)

    assert run(handler, client_code) == b"data: 1\n\n"


def test_chunks_arrive_as_sent_and_closing_early_hangs_up_on_the_server():
    gone = asyncio.Event()
    first_read = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await first_read.wait()  # the client has the first event before the second is sent
        writer.write(b"9\r\ndata: 2\n\n\r\n")
        await writer.drain()
        if await reader.read(1) == b"":  # EOF: the client closed the connection
            gone.set()

    async def client_code(client, url):
        async with client.stream("POST", url + "/v1/completions", content=b"{}") as r:
            chunks = r.aiter_raw()
            first = await anext(chunks)
            first_read.set()
            second = await anext(chunks)
        await asyncio.wait_for(gone.wait(), 5)
        return first, second

    assert run(handler, client_code) == (b"data: 1\n\n", b"data: 2\n\n")


def test_a_complete_answer_returns_its_connection_for_the_next_request():
    peers = []

    async def handler(reader, writer):
        peers.append(writer.get_extra_info("peername"))
        for _ in range(2):
            await read_request(reader)
            writer.write(response(200, b"ok"))
            await writer.drain()
        writer.close()

    async def client_code(client, url):
        return [(await client.get(url + f"/{i}")).content for i in range(2)]

    assert run(handler, client_code) == [b"ok", b"ok"]
    assert len(peers) == 1
