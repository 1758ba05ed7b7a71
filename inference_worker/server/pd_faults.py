"""KV hand-off fault rehearsal: faults a prefill worker injects on purpose (``serve --fault-kv MODE``).

Like ``--fault-error-rate``, this is for rehearsing a bad release or a bad KV link on a worker that
takes no production traffic (does the decode pool fall back to local prefill, do the transfer-failure
metrics and rollout gates see it?); it is off unless the option is given. Modes (what the decode side
then sees):

- ``corrupt``: one payload byte flipped after sealing -> ``checksum``;
- ``truncate``: half the frame, then the connection is closed -> ``truncated``;
- ``wrong-key``: sealed with another link secret -> ``auth``;
- ``wrong-version``: the frame names another model version -> ``version_mismatch``;
- ``delay:S``: the frame is sent S seconds late -> ``timeout`` on decode, then ``late``;
- ``die-mid-send``: half the frame, then the prefill process kills itself (SIGKILL) -> ``truncated``
  and a broken HTTP hand-off;
- ``header``: TEST HOOK, no fault of its own: each request may name one of the modes above in the
  :data:`~inference_worker.http_headers.FAULT_KV` header, so one test worker serves many faults.

The ``header`` mode is a test hook, not a rehearsal option: any client that can reach a worker could
pick a fault per request. It is therefore off by default on both sides and enabled only when the
environment variable :data:`TEST_HEADER_ENV` (``FERRY_TEST_KV_FAULT_HEADER``) is ``1``, which only the
PD worker tests set: a decode worker forwards the header to the prefill worker only then, and
``--fault-kv header`` is refused without it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from collections.abc import Mapping

from inference_worker.kv_transfer.connection import open_connection
from inference_worker.kv_transfer.errors import ERRORS_BY_REASON, KVTransferError, TruncatedPayload
from inference_worker.kv_transfer.wire import ACK_LENGTH, KVFrame, parse_ack

TEST_HEADER_ENV = "FERRY_TEST_KV_FAULT_HEADER"
"""TEST ONLY: set to ``1`` to let requests choose a KV fault by header (see the module docstring)."""
MODES = ("corrupt", "truncate", "wrong-key", "wrong-version", "delay", "die-mid-send", "header")
RAW_MODES = ("corrupt", "truncate", "wrong-key", "die-mid-send")
"""Modes sent by :func:`send_faulty_frame` instead of the real sender."""


def fault_header_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the per-request fault header test hook is on: ``environ[TEST_HEADER_ENV] == "1"``."""
    return environ.get(TEST_HEADER_ENV) == "1"


def parse_fault(value: str | None) -> tuple[str, float] | None:
    """``"delay:2.5"`` -> ``("delay", 2.5)``; ``"corrupt"`` -> ``("corrupt", 0.0)``; None/"" -> None.

    Raises:
        ValueError: an unknown mode or a bad delay.
    """
    if not value:
        return None
    mode, _, arg = value.partition(":")
    if mode not in MODES:
        raise ValueError(f"--fault-kv must be one of {MODES} (delay as delay:SECONDS), got {value!r}")
    if mode == "delay":
        try:
            seconds = float(arg)
        except ValueError:
            raise ValueError(f"--fault-kv delay needs seconds, e.g. delay:3, got {value!r}") from None
        if seconds < 0:
            raise ValueError(f"--fault-kv delay must be >= 0 seconds, got {seconds}")
        return mode, seconds
    if arg:
        raise ValueError(f"--fault-kv {mode} takes no argument, got {value!r}")
    return mode, 0.0


async def send_faulty_frame(mode: str, frame: KVFrame, *, host: str, port: int, link_secret: bytes,
                            timeout_s: float) -> None:
    """Send ``frame`` to ``host:port`` damaged as ``mode`` (one of :data:`RAW_MODES`).

    Raises:
        KVTransferError: the receiver's verdict (``checksum``, ``auth``) or ``truncated`` when the frame
            was cut on purpose; never returns normally for these modes unless the receiver accepted it.
    """
    if mode == "wrong-key":
        data = bytearray(frame.to_bytes(hashlib.sha256(b"not the link secret" + link_secret).digest()))
    else:
        data = bytearray(frame.to_bytes(link_secret))
    if mode == "corrupt":
        data[frame.payload_offset + frame.payload_bytes // 2] ^= 0x01
    conn = await asyncio.wait_for(open_connection(host, port), timeout_s)
    try:
        if mode in ("truncate", "die-mid-send"):
            await conn.send(memoryview(data)[: len(data) // 2])
            if mode == "die-mid-send":
                os.kill(os.getpid(), signal.SIGKILL)
            raise TruncatedPayload("frame cut in half on purpose (--fault-kv truncate)")
        await conn.send(data)
        length = ACK_LENGTH.unpack(await asyncio.wait_for(conn.recv_exactly(ACK_LENGTH.size), timeout_s))[0]
        reason, detail = parse_ack(await asyncio.wait_for(conn.recv_exactly(length), timeout_s))
    finally:
        conn.close()
    if reason is not None:
        raise ERRORS_BY_REASON.get(reason, KVTransferError)(f"receiver rejected the KV: {detail}")
