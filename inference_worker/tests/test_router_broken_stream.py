"""A stream whose upstream breaks mid-answer (its worker killed) ends for the client with an OpenAI error event and
``data: [DONE]``, never a cut event (the chaos matrix's "only replica serving a stream killed" case).

In process, no sockets: ``Router._relay`` over an ``httpx.Response`` whose byte stream raises the error httpx
raises when a peer closes a chunked body early.
"""

import asyncio
import json

import httpx

from inference_worker.router.app import Router, RouterConfig
from inference_worker.router.table import Replica

REPLICA = Replica(name="decode-stable-0", url="http://127.0.0.1:9", pool="decode", role="decode", track="stable",
                  model_version="v1")


class BreaksAfter(httpx.AsyncByteStream):
    """Yields ``chunks`` then, if ``error``, raises it (as httpx does for a body cut by the peer)."""

    def __init__(self, chunks: list[bytes], error: Exception | None):
        self.chunks, self.error = chunks, error

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error


def relay(chunks: list[bytes], *, error: Exception | None, content_type: str = "text/event-stream") -> tuple[bytes, Router]:
    """What the client receives from ``Router._relay`` for an upstream answering ``chunks`` then ``error``."""
    router = Router(RouterConfig(routing_table="unused.json"))
    response = httpx.Response(200, headers={"content-type": content_type}, stream=BreaksAfter(chunks, error))

    async def run() -> bytes:
        router.loads.begin(REPLICA)
        raw = response.aiter_raw()
        first = await anext(raw, b"")
        return b"".join([piece async for piece in router._relay(first, raw, response, REPLICA)])

    return asyncio.run(run()), router


def events(body: bytes) -> list[str]:
    assert body.endswith(b"\n\n"), f"the stream ends inside an event: {body[-40:]!r}"
    return [block.decode().removeprefix("data: ") for block in body.split(b"\n\n") if block]


def test_an_upstream_that_breaks_mid_event_ends_the_stream_with_an_error_event_and_done():
    cut = httpx.RemoteProtocolError("peer closed connection without sending complete message body")
    body, router = relay([b'data: {"i": 0}\n\ndata: {"i"', b': 1}\n\ndata: {"i": 2, "te'], error=cut)
    out = events(body)
    assert out[:2] == ['{"i": 0}', '{"i": 1}']  # whole events only: the cut third one is dropped
    error = json.loads(out[2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_stream_broken")
    assert "decode-stable-0" in error["message"] and "RemoteProtocolError" in error["message"]
    assert out[3:] == ["[DONE]"]
    assert router.metrics.upstream_errors.labels(pool="decode", replica="decode-stable-0", kind="stream")._value.get() == 1
    assert router.loads.in_flight["decode-stable-0"] == 0


def test_a_whole_stream_is_passed_through_unchanged_and_a_non_sse_body_is_not_reframed():
    chunks = [b'data: {"i": 0}\n\nda', b'ta: {"i": 1}\n\n', b"data: [DONE]\n\n"]
    body, _ = relay(chunks, error=None)
    assert body == b"".join(chunks)
    body, _ = relay([b'{"a": ', b"1}"], error=None, content_type="application/json")
    assert body == b'{"a": 1}'
    cut = httpx.ReadError("connection reset")
    body, _ = relay([b'{"a": '], error=cut, content_type="application/json")
    assert body == b'{"a": '  # not an event stream: nothing to frame an error in; the client sees a cut body
