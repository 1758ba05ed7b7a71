"""Decode-side KV receiver: an asyncio TCP server that validates frames and hands them out by request id.

Flow on the decode worker: ``receiver.expect(request_id)`` *before* asking a prefill worker for the
KV, then ``await receiver.wait(request_id, timeout_s)``; it returns the :class:`~.wire.KVPayload` or
raises (:class:`~.errors.Timeout` at the deadline, :class:`~.errors.WrongWeights` as soon as an
authentic frame from another model arrives). After a deadline the request id is remembered as given
up: a payload for it that arrives later is rejected as ``late`` and counted; a payload nobody
expects is rejected as ``unexpected``. The decode side never blocks past its deadline.

Memory before authentication is bounded (KV protocol 3, :mod:`.wire`): the preamble goes into 32 bytes,
the header and its tag into a buffer of at most ``MAX_HEADER_BYTES + 32``; the payload buffer is
allocated only for a frame whose header tag verifies, whose model identity and sizes are consistent
(the payload at most what the model's KV geometry holds for ``max_num_tokens``; see
:attr:`KVReceiver.max_frame_payload_bytes`) and whose request a decode request is waiting for. A
protocol-2 frame (accepted for one release) has no header tag: its payload buffer is allocated only when
its header names a request that is waiting and sizes of the model's geometry (request ids are random,
so a peer without the secret cannot name one), and the trailer tag decides as before. A connection
that lies -- bad magic or protocol, an oversized length, a header tag that does not verify, an
unauthenticated header that names no waiting request -- gets its ack and is closed at once
(``recorder.drop``: ``ferry_kv_connections_dropped_total{reason}``); an authentic frame the receiver
refuses (another model version, a late or unexpected request) is read past with a fixed 64 KiB scratch
buffer so the sender gets its ack and may reuse the connection.

Frames are read with a :class:`asyncio.BufferedProtocol` straight into one preallocated buffer per
frame (no intermediate copies; tensors of the payload are views of it), the keyed-BLAKE3 tag is
computed on the event loop as bytes arrive, at least 1 MiB at a time (about 0.13 ms per MiB at the
8 GB/s measured on this machine; a hashing thread cost more CPU in thread hand-offs than it saved),
and a frame that makes no progress for ``read_timeout_s`` is dropped as ``timeout``; a connection
that ends mid-frame (e.g. a killed prefill worker) is counted as ``truncated``.
Every frame gets an ack with its outcome. Counting: each frame is one transfer (direction
``receive``); a ``wait`` that reaches its deadline counts one more ``timeout``.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import time
from collections import OrderedDict

import numpy as np

from inference_worker.kv_transfer.errors import (
    CorruptPayload,
    KVTransferError,
    LatePayload,
    PayloadTooLarge,
    Timeout,
    TruncatedPayload,
    UnexpectedPayload,
    WrongWeights,
)
from inference_worker.kv_transfer.layout import KVLayout
from inference_worker.kv_transfer.recorder import RECEIVE, TransferRecorder
from inference_worker.kv_transfer.wire import (
    ACCEPTED_PROTOCOLS,
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREAMBLE,
    TRAILER,
    KVPayload,
    LinkKey,
    Preamble,
    check_identity,
    decode_payload,
    encode_ack,
    max_payload_bytes,
    parse_header,
    parse_preamble,
    verify_header_tag,
    verify_trailer,
)

_HASH_BATCH_BYTES = 1 << 20  # hash at least this much at a time (fewer, more efficient MAC updates)
_SCRATCH_BYTES = 1 << 16  # the buffer bytes that are read past land in (one per connection)
DROP_GRACE_S = 0.5
"""Seconds a dropped connection stays half-open (our side closed) before it is closed."""
DROP_GRACE_BYTES = 64 << 20
"""Bytes a dropped connection may still send during its grace before it is closed at once: on loopback a liar
pushes ~2 GB/s, so the grace is bounded in bytes as well as in time (64 MiB read past into the scratch buffer)."""


class KVReceiver:
    """TCP server for KV frames of one model version.

    Args:
        link_secret: per-link secret shared with the senders (>= 16 bytes; the MAC key is derived from it).
        model_version_id, weights_sha256: identity the KV must carry (else ``version_mismatch``).
        layout: optional expected :class:`KVLayout`; a different one is rejected as corrupt.
        ssl: optional server ``SSLContext`` for TLS.
        read_timeout_s: a frame that makes no progress for this long is dropped (``timeout``).
        max_payload_bytes: larger frames are refused (``capacity``); with ``layout`` and ``max_num_tokens`` the
            limit is the smaller of this and what the geometry allows (:attr:`max_frame_payload_bytes`).
        max_num_tokens: the decode worker's max context, tokens: a frame for more tokens is refused
            (``capacity``) before its payload is read.
        accepted_protocols: wire protocols read (this release: 2 and 3).
        max_given_up: how many given-up request ids are remembered for ``late`` detection.
    """

    def __init__(self, *, link_secret: bytes, model_version_id: str, weights_sha256: str,
                 layout: KVLayout | None = None, host: str = "127.0.0.1", port: int = 0,
                 ssl: ssl_module.SSLContext | None = None, read_timeout_s: float = 10.0,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, recorder: TransferRecorder | None = None,
                 max_num_tokens: int | None = None, accepted_protocols: tuple[int, ...] = ACCEPTED_PROTOCOLS,
                 max_given_up: int = 65536):
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be positive, got {read_timeout_s}")
        if max_num_tokens is not None and max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be positive, got {max_num_tokens}")
        unknown = set(accepted_protocols) - set(ACCEPTED_PROTOCOLS)
        if not accepted_protocols or unknown:
            raise ValueError(f"accepted_protocols must be a non-empty subset of {ACCEPTED_PROTOCOLS}")
        self.max_num_tokens, self.accepted_protocols = max_num_tokens, tuple(accepted_protocols)
        self.link_key = LinkKey(link_secret)
        self.model_version_id, self.weights_sha256 = model_version_id, weights_sha256
        self.layout, self.host, self.port, self._ssl = layout, host, port, ssl
        self.read_timeout_s, self.max_payload_bytes = read_timeout_s, max_payload_bytes
        self.recorder = recorder if recorder is not None else TransferRecorder()
        self._waiting: dict[str, asyncio.Future[KVPayload]] = {}
        self._given_up: OrderedDict[str, None] = OrderedDict()
        self._max_given_up = max_given_up
        self._server: asyncio.Server | None = None

    @property
    def max_frame_payload_bytes(self) -> int:
        """Largest payload a preamble may announce: ``max_payload_bytes``, lowered with a layout and
        ``max_num_tokens`` to :func:`.wire.max_payload_bytes` of ``layout.transfer_bytes(max_num_tokens)``."""
        if self.layout is None or self.max_num_tokens is None:
            return self.max_payload_bytes
        return min(self.max_payload_bytes, max_payload_bytes(self.layout.transfer_bytes(self.max_num_tokens)))

    def is_waiting(self, request_id: str) -> bool:
        """True while a decode request waits for ``request_id``'s KV."""
        fut = self._waiting.get(request_id)
        return fut is not None and not fut.done()

    def check_sizes(self, header: dict, payload_len: int) -> None:
        """Check a header's token count and sizes against this receiver's geometry before reading its payload.

        Raises:
            PayloadTooLarge: more tokens than ``max_num_tokens``.
            CorruptPayload: missing or inconsistent sizes.
        """
        try:
            num_tokens, raw_bytes = int(header["num_tokens"]), int(header["raw_bytes"])
            payload_bytes, compression = int(header["payload_bytes"]), header["compression"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptPayload(f"invalid KV header: {exc!r}") from exc
        if num_tokens < 1:
            raise CorruptPayload(f"num_tokens {num_tokens} must be positive")
        if self.max_num_tokens is not None and num_tokens > self.max_num_tokens:
            raise PayloadTooLarge(f"KV for {num_tokens} tokens exceeds this worker's context of "
                                  f"{self.max_num_tokens}")
        if self.layout is not None and raw_bytes != self.layout.transfer_bytes(num_tokens):
            raise CorruptPayload(f"raw_bytes {raw_bytes} is not this model's KV for {num_tokens} tokens "
                                 f"({self.layout.transfer_bytes(num_tokens)})")
        limit = raw_bytes if compression == "none" else max_payload_bytes(raw_bytes)
        if payload_bytes != payload_len or not 0 <= payload_len <= limit:
            raise CorruptPayload(f"payload of {payload_len} bytes (header says {payload_bytes}) does not fit "
                                 f"{raw_bytes} raw bytes compressed as {compression!r}")

    async def start(self) -> KVReceiver:
        """Listen; ``self.port`` is the bound port afterwards (pass port 0 for any free port)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _FrameProtocol(self), self.host, self.port, ssl=self._ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening and fail every pending wait with Timeout."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(Timeout("receiver closed"))
        self._waiting.clear()

    def expect(self, request_id: str) -> None:
        """Announce that a payload for ``request_id`` will come (call before triggering the prefill)."""
        if request_id not in self._waiting:
            self._waiting[request_id] = asyncio.get_running_loop().create_future()
            self._given_up.pop(request_id, None)

    def give_up(self, request_id: str) -> None:
        """Stop waiting for ``request_id``; a payload for it arriving afterwards is rejected as late."""
        fut = self._waiting.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        self._given_up[request_id] = None
        while len(self._given_up) > self._max_given_up:
            self._given_up.popitem(last=False)

    async def wait(self, request_id: str, timeout_s: float) -> KVPayload:
        """The payload for ``request_id`` (registering it if :meth:`expect` was not called).

        Raises:
            Timeout: nothing valid arrived within ``timeout_s``; the id is then given up.
            WrongWeights: an authentic payload for it came from another model version.
        """
        self.expect(request_id)
        fut = self._waiting[request_id]
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError as exc:
            self.recorder.failure(RECEIVE, Timeout.reason)
            raise Timeout(f"no KV for request {request_id!r} within {timeout_s}s") from exc
        finally:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._waiting.pop(request_id, None)
            else:
                self.give_up(request_id)

    def _deliver(self, payload: KVPayload) -> None:
        rid = payload.request_id
        fut = self._waiting.get(rid)
        if fut is None or fut.done():
            if rid in self._given_up:
                raise LatePayload(f"request {rid!r} was given up before its KV arrived")
            raise UnexpectedPayload(f"no decode request is waiting for {rid!r}")
        fut.set_result(payload)

    def _deliver_check(self, request_id: str) -> None:
        """Raise the error :meth:`_deliver` would for a request nobody waits for (late or unexpected)."""
        if request_id in self._given_up:
            raise LatePayload(f"request {request_id!r} was given up before its KV arrived")
        raise UnexpectedPayload(f"no decode request is waiting for {request_id!r}")

    def _reject_authentic(self, request_id: str, exc: KVTransferError) -> None:
        fut = self._waiting.get(request_id)
        if fut is not None and not fut.done() and isinstance(exc, WrongWeights):
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: wait() may not be awaiting yet


class _FrameProtocol(asyncio.BufferedProtocol):
    """Per-connection state machine: preamble -> head (header and, protocol 3, its tag) -> body (payload and
    trailer) or skip (an authentic frame refused) -> ack -> next frame (see the module docstring)."""

    def __init__(self, receiver: KVReceiver):
        self.r = receiver
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._scratch: memoryview | None = None
        self._read_past_closed = 0  # bytes received after our side closed (bounded: DROP_GRACE_BYTES)
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self._pre = bytearray(PREAMBLE.size)
        self._target = memoryview(self._pre)
        self._pos = 0
        self._state = "preamble"
        self._preamble: Preamble | None = None
        self._head: bytearray | None = None
        self._body: np.ndarray | None = None
        self._covered = 0  # body bytes covered by the tag (the payload)
        self._mac_pos = 0
        self._mac = None
        self._header: dict | None = None
        self._skip = 0  # bytes still to read past (state "skip")
        self._skip_error: KVTransferError | None = None
        self._started: float | None = None

    @property
    def _mid_frame(self) -> bool:
        return self._pos > 0 or self._state != "preamble"

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._last_progress = time.monotonic()
        self._schedule_check()

    def _schedule_check(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.r.read_timeout_s / 4, self._check_progress)

    def _check_progress(self) -> None:
        if self._closed:
            return
        if self._mid_frame and time.monotonic() - self._last_progress > self.r.read_timeout_s:
            self._fail(Timeout(f"frame stalled for more than {self.r.read_timeout_s}s"))
            self._close()
            return
        self._schedule_check()

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        return self._scratch

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._closed:
            return self._scratch_view()
        if self._state == "skip":
            return self._scratch_view()[:min(_SCRATCH_BYTES, self._skip)]
        return self._target[self._pos:]

    def buffer_updated(self, nbytes: int) -> None:
        self._last_progress = time.monotonic()
        if self._closed:
            self._read_past_closed += nbytes
            if self._read_past_closed > DROP_GRACE_BYTES and self.transport is not None:
                self.transport.close()
            return
        if self._started is None:
            self._started = time.perf_counter()
        if self._state == "skip":
            self._skip -= nbytes
            if self._skip == 0:
                error = self._skip_error
                self._reset()
                self._fail(error)
            return
        self._pos += nbytes
        if self._pos < len(self._target) and self._state != "body":
            return
        if self._state == "preamble":
            self._begin_head()
        elif self._state == "head":
            self._end_head()
        else:
            self._body_progress()

    # ---- preamble and head: bounded buffers, nothing trusted yet ---------------------------------------
    def _begin_head(self) -> None:
        try:
            self._preamble = pre = parse_preamble(self._pre, self.r.max_frame_payload_bytes, self.r.accepted_protocols)
        except KVTransferError as exc:
            self._drop(exc)
            return
        self._head = bytearray(pre.header_len + pre.header_tag_len)  # at most MAX_HEADER_BYTES + 32
        self._target, self._pos, self._state = memoryview(self._head), 0, "head"

    def _end_head(self) -> None:
        pre, head = self._preamble, self._head
        header_bytes = memoryview(head)[:pre.header_len]
        request_id = None
        try:
            if pre.header_tag_len:
                verify_header_tag(head[pre.header_len:], bytes(self._pre) + bytes(header_bytes), pre.key_id,
                                  self.r.link_key)
            header = parse_header(header_bytes)
        except KVTransferError as exc:
            self._drop(exc)
            return
        if not pre.header_tag_len:  # protocol 2: nothing authenticated; allocate only for a waiting request
            request_id = str(header.get("request_id"))
            try:
                if not self.r.is_waiting(request_id):
                    raise UnexpectedPayload(f"no decode request is waiting for {request_id!r} (protocol 2 "
                                            f"frame, header not authenticated)")
                self.r.check_sizes(header, pre.payload_len)
            except KVTransferError as exc:
                self._drop(exc)
                return
            self._begin_body(header)
            return
        request_id = str(header.get("request_id"))
        try:  # protocol 3: the header is authentic; refusals keep the connection (the payload is read past)
            check_identity(header, model_version_id=self.r.model_version_id, weights_sha256=self.r.weights_sha256)
            self.r.check_sizes(header, pre.payload_len)
            if not self.r.is_waiting(request_id):
                self.r._deliver_check(request_id)
        except KVTransferError as exc:
            self.r._reject_authentic(request_id, exc)
            self._state, self._skip, self._skip_error = "skip", pre.payload_len + TRAILER.size, exc
            self._target = memoryview(b"")
            return
        self._begin_body(header)

    # ---- body: allocated only for a frame that passed the checks above -----------------------------
    def _begin_body(self, header: dict) -> None:
        pre = self._preamble
        self._header = header
        self._covered = pre.payload_len
        # np.empty: no zero-fill pass over a buffer the socket is about to overwrite.
        self._body = np.empty(self._covered + TRAILER.size, dtype=np.uint8)
        self._target, self._pos, self._state = memoryview(self._body), 0, "body"
        self._mac = self.r.link_key.mac(self._pre)
        self._mac.update(self._head)
        if len(self._body) == 0:
            self._body_progress()

    def _body_progress(self) -> None:
        end = min(self._pos, self._covered)
        if end - self._mac_pos >= _HASH_BATCH_BYTES or (end == self._covered and self._mac_pos < end):
            self._mac.update(self._target[self._mac_pos:end])
            self._mac_pos = end
        if self._pos == len(self._body):
            pre = self._preamble
            wire_bytes = PREAMBLE.size + len(self._head) + len(self._body)
            frame = (self._mac, pre.key_id, self._target, self._header, self._covered, self._started, wire_bytes)
            self._reset()
            self._finish_frame(*frame)

    def _finish_frame(self, mac, key_id: bytes, body, header: dict, end: int, started: float,
                      wire_bytes: int) -> None:
        request_id = None
        try:
            verify_trailer(mac.digest(), body[end:], key_id, self.r.link_key)
            request_id = str(header.get("request_id"))
            check_identity(header, model_version_id=self.r.model_version_id, weights_sha256=self.r.weights_sha256)
            payload = decode_payload(header, body[:end], wire_bytes=wire_bytes, layout=self.r.layout)
            self.r._deliver(payload)
        except KVTransferError as exc:
            if request_id is not None:
                self.r._reject_authentic(request_id, exc)
            self._fail(exc)
            return
        self.r.recorder.success(RECEIVE, raw_bytes=payload.raw_bytes, wire_bytes=payload.wire_bytes,
                                seconds=time.perf_counter() - started)
        if not self.transport.is_closing():
            self.transport.write(encode_ack(None))

    # ---- outcomes -------------------------------------------------------------------------------
    def _fail(self, exc: KVTransferError) -> None:
        self.r.recorder.failure(RECEIVE, exc.reason)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_ack(exc.reason, str(exc)))

    def _drop(self, exc: KVTransferError) -> None:
        """The peer lied (or speaks another protocol): ack with the reason, count, and drop the connection.

        The ack is followed by our FIN; what the peer still sends lands in the 64 KiB scratch buffer for at
        most :data:`DROP_GRACE_S` and :data:`DROP_GRACE_BYTES` (so an honest sender of an old protocol reads its
        ack instead of a reset), then the connection is closed."""
        self._fail(exc)
        self.r.recorder.drop(exc.reason)
        self._close(grace_s=DROP_GRACE_S)

    def _close(self, grace_s: float = 0.0) -> None:
        self._reset()
        self._closed = True  # closing: connection_lost must not count this frame again
        if self.transport is None or self.transport.is_closing():
            return
        if grace_s > 0 and self.transport.can_write_eof():
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(grace_s, self.transport.close)
        else:
            self.transport.close()

    def eof_received(self) -> bool:
        if self._mid_frame and not self._closed:
            self._fail(TruncatedPayload("the sender closed the connection mid-frame"))
            self._reset()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._mid_frame and not self._closed:
            self._fail(TruncatedPayload(f"the connection was lost mid-frame: {exc!r}"))
        self._reset()
        self._closed = True
