"""Asyncio TCP transport for KV frames: the prefill-side sender (:class:`KVSender`).

The decode-side receiver is :class:`inference_worker.kv_transfer.receiver.KVReceiver` (re-exported
here). One connection carries frames one after another; after each frame the receiver answers with
an ack (``wire.encode_ack``): success or the failure reason.

Sender behaviour: connect with ``connect_timeout_s``; stream the frame in chunks (each taken from the
link's :class:`~inference_worker.kv_transfer.bucket.TokenBucket` when a bandwidth cap is set, so a
loopback link can emulate a WAN), each chunk fed to the keyed-BLAKE3 tag just before it is written
(no copy of the KV; about 0.13 ms per MiB on the loop: on a 2-core machine a hashing thread cost
more in hand-offs than it overlapped); every write and the ack read are bounded by ``io_timeout_s``. A failure whose error
class is ``retryable`` (connection, timeout, checksum, truncated) is retried up to ``max_attempts``
times with exponential backoff ``backoff_s * 2**attempt`` capped at ``backoff_max_s``; others
(auth, version mismatch, late, unexpected, capacity) are raised at once. TLS: pass an
``ssl.SSLContext`` (and ``server_hostname`` if it differs from ``host``).

A connection is reused for the next frame only after the receiver accepted a frame on it: after a
rejection the receiver may have closed it (a frame whose preamble or header it cannot trust is acked and
dropped), so the next attempt starts on a fresh connection. When a write fails because the receiver
dropped the connection, the sender still reads the ack it left and raises that reason.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import time

from inference_worker.kv_transfer.bucket import TokenBucket
from inference_worker.kv_transfer.connection import SocketConnection, StreamConnection, open_connection
from inference_worker.kv_transfer.errors import (
    ERRORS_BY_REASON,
    ConnectionFailed,
    CorruptPayload,
    KVTransferError,
    Timeout,
)
from inference_worker.kv_transfer.receiver import KVReceiver
from inference_worker.kv_transfer.recorder import SEND, TransferRecorder
from inference_worker.kv_transfer.wire import (
    ACK_LENGTH,
    MAX_ACK_BYTES,
    FrameSealer,
    KVFrame,
    LinkKey,
    parse_ack,
)

__all__ = ["KVReceiver", "KVSender"]


class KVSender:
    """Sends KV frames to one receiver (one link), reusing an idle connection when there is one.

    Args:
        host, port: the receiver's address.
        link_secret: per-link secret (>= 16 bytes), shared with the receiver; the MAC key is derived from it.
        ssl: optional client ``SSLContext`` for TLS.
        bandwidth_gbps: cap on this link, Gbit/s (None: uncapped); or pass ``bucket`` directly.
        chunk_bytes: bytes per write (and per token-bucket acquire).
        recorder: where transfers are counted (direction ``send``).

    Raises:
        ValueError: invalid secret or limits.
    """

    def __init__(self, host: str, port: int, *, link_secret: bytes, ssl: ssl_module.SSLContext | None = None,
                 server_hostname: str | None = None, connect_timeout_s: float = 5.0, io_timeout_s: float = 30.0,
                 max_attempts: int = 3, backoff_s: float = 0.05, backoff_max_s: float = 2.0,
                 bandwidth_gbps: float | None = None, bucket: TokenBucket | None = None,
                 chunk_bytes: int = 1 << 20, recorder: TransferRecorder | None = None):
        if max_attempts < 1 or connect_timeout_s <= 0 or io_timeout_s <= 0 or chunk_bytes < 1:
            raise ValueError("max_attempts, timeouts and chunk_bytes must be positive")
        self.host, self.port = host, port
        self._link_key = LinkKey(link_secret)
        self._ssl, self._server_hostname = ssl, server_hostname
        self.connect_timeout_s, self.io_timeout_s = connect_timeout_s, io_timeout_s
        self.max_attempts, self.backoff_s, self.backoff_max_s = max_attempts, backoff_s, backoff_max_s
        if bucket is None and bandwidth_gbps is not None:
            bucket = TokenBucket.for_link(bandwidth_gbps, burst_bytes=max(chunk_bytes, 1 << 16))
        self.bucket = bucket
        self.chunk_bytes = chunk_bytes
        self.recorder = recorder if recorder is not None else TransferRecorder()
        self.num_attempts = 0
        """Attempts made over this sender's life (retries included)."""
        self.num_failed_attempts = 0
        """Attempts that raised (the retried ones and the last failed one)."""
        self._idle: list[SocketConnection | StreamConnection] = []

    async def send(self, frame: KVFrame) -> float:
        """Deliver ``frame``; return the seconds it took (all attempts). Raises as :meth:`send_measured`."""
        return (await self.send_measured(frame))[0]

    async def send_measured(self, frame: KVFrame) -> tuple[float, float]:
        """Deliver ``frame``; return ``(seconds, cap_wait_s)``: the seconds it took (all attempts) and, of them,
        the seconds spent waiting for the link's bandwidth cap (0 without a cap).

        Raises:
            ConnectionFailed, Timeout, CorruptPayload, TruncatedPayload: after ``max_attempts``.
            AuthenticationFailed, WrongWeights, LatePayload, UnexpectedPayload, PayloadTooLarge,
            ProtocolVersionMismatch: at once (the receiver rejected the frame for that reason).
        """
        start = time.perf_counter()
        attempt = 0
        cap_wait = [0.0]
        while True:
            try:
                await self._send_once(frame, cap_wait)
                break
            except KVTransferError as exc:
                attempt += 1
                self.num_failed_attempts += 1
                if not exc.retryable or attempt >= self.max_attempts:
                    self.recorder.failure(SEND, exc.reason)
                    raise
                await asyncio.sleep(min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1)))
        seconds = time.perf_counter() - start
        self.recorder.success(SEND, raw_bytes=frame.raw_bytes, wire_bytes=frame.wire_bytes, seconds=seconds)
        return seconds, cap_wait[0]

    async def close(self) -> None:
        """Close idle connections."""
        while self._idle:
            self._idle.pop().close()

    async def _connection(self) -> SocketConnection | StreamConnection:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                return conn
            conn.close()
        try:
            return await asyncio.wait_for(
                open_connection(self.host, self.port, ssl=self._ssl,
                                server_hostname=self._server_hostname if self._ssl else None),
                self.connect_timeout_s)
        except TimeoutError as exc:
            raise Timeout(f"connect to {self.host}:{self.port} timed out after {self.connect_timeout_s}s") from exc
        except (OSError, ssl_module.SSLError) as exc:
            raise ConnectionFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc

    async def _ack_after_drop(self, conn) -> KVTransferError | None:
        """The receiver's verdict when it closed the connection mid-frame (it acks a frame it drops, then closes:
        see :mod:`.receiver`), or None if no ack can be read within a second."""
        try:
            async with asyncio.timeout(1.0):
                length = ACK_LENGTH.unpack(await conn.recv_exactly(ACK_LENGTH.size))[0]
                if length > MAX_ACK_BYTES:
                    return None
                reason, detail = parse_ack(await conn.recv_exactly(length))
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ssl_module.SSLError, CorruptPayload):
            return None
        if reason is None:
            return None
        return ERRORS_BY_REASON.get(reason, KVTransferError)(f"receiver rejected the KV and closed the connection: "
                                                            f"{detail}")

    async def _send_once(self, frame: KVFrame, cap_wait: list[float] | None = None) -> None:
        """One attempt; adds the seconds waited on the bandwidth cap to ``cap_wait[0]``."""
        cap_wait = [0.0] if cap_wait is None else cap_wait
        self.num_attempts += 1
        conn = await self._connection()
        try:
            sealer = FrameSealer(self._link_key)
            loop = asyncio.get_running_loop()
            # One deadline for the whole stream, pushed back before each write: "no progress for
            # io_timeout_s" without a task per chunk (as wait_for would make); a bandwidth-cap wait is
            # not counted.
            async with asyncio.timeout(None) as deadline:
                for chunk in frame.iter_chunks(self.chunk_bytes, link_key=self._link_key):
                    sealer.update(chunk)
                    if self.bucket is not None:
                        deadline.reschedule(None)
                        waited = time.perf_counter()
                        await self.bucket.acquire(len(chunk))
                        cap_wait[0] += time.perf_counter() - waited
                    deadline.reschedule(loop.time() + self.io_timeout_s)
                    await conn.send(chunk)
            trailer = sealer.trailer()
            if self.bucket is not None:
                await self.bucket.acquire(len(trailer))
            async with asyncio.timeout(self.io_timeout_s):
                await conn.send(trailer)
                length = ACK_LENGTH.unpack(await conn.recv_exactly(ACK_LENGTH.size))[0]
                if length > MAX_ACK_BYTES:
                    raise CorruptPayload(f"ack of {length} bytes")
                reason, detail = parse_ack(await conn.recv_exactly(length))
        except TimeoutError as exc:
            conn.close()
            raise Timeout(f"no progress sending to {self.host}:{self.port} within {self.io_timeout_s}s") from exc
        except (OSError, asyncio.IncompleteReadError, ssl_module.SSLError) as exc:
            verdict = await self._ack_after_drop(conn)
            conn.close()
            if verdict is not None:
                raise verdict from exc
            raise ConnectionFailed(f"connection to {self.host}:{self.port} broke: {exc!r}") from exc
        except BaseException:
            conn.close()
            raise
        if reason is not None:
            conn.close()
            raise ERRORS_BY_REASON.get(reason, KVTransferError)(f"receiver rejected the KV: {detail}")
        self._idle.append(conn)

