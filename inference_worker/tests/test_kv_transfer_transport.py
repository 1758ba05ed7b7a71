"""KV transfer over real TCP: delivery, every failure rejected and counted by reason, retries, TLS, late KV."""

import asyncio
import dataclasses
import os
import ssl
import subprocess
import sys
import textwrap

import pytest
import torch
from prometheus_client import CollectorRegistry

from inference_worker.kv_transfer.errors import (
    AuthenticationFailed,
    ConnectionFailed,
    LatePayload,
    PayloadTooLarge,
    ProtocolVersionMismatch,
    Timeout,
    UnexpectedPayload,
    WrongWeights,
)
from inference_worker.kv_transfer.recorder import TransferRecorder
from inference_worker.kv_transfer.transport import KVReceiver, KVSender
from inference_worker.kv_transfer.wire import encode_kv
from inference_worker.metrics import WorkerMetrics
from inference_worker.tests.test_kv_transfer_wire import SECRET, WEIGHTS, gemma_layout, make_kv

torch.set_num_threads(1)
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
LAYOUT = gemma_layout()
N = 600
KV = make_kv(LAYOUT, N)


def frame(request_id="req-1", model_version_id="v1", compression="none"):
    return encode_kv(request_id=request_id, model_version_id=model_version_id, weights_sha256=WEIGHTS,
                     layout=LAYOUT, num_tokens=N, kv=KV, compression=compression)


async def start_receiver(**kw):
    args = dict(link_secret=SECRET, model_version_id="v1", weights_sha256=WEIGHTS, layout=LAYOUT,
                read_timeout_s=0.4)
    args.update(kw)
    return await KVReceiver(**args).start()


def sender(receiver, **kw):
    args = dict(link_secret=SECRET, max_attempts=3, backoff_s=0.01, io_timeout_s=2.0)
    args.update(kw)
    return KVSender("127.0.0.1", receiver.port, **args)


async def send_raw(port, data, close=True):
    """Write raw bytes on a fresh connection and return the receiver's ack reason (None = accepted)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    length = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 5), "big")
    import json
    ack = json.loads(await reader.readexactly(length))
    if close:
        writer.close()
    return None if ack["ok"] else ack["reason"]


async def test_delivers_exact_kv_and_counts_bytes_in_worker_metrics():
    metrics = WorkerMetrics({"model": "gemma-3-270m", "role": "decode"}, CollectorRegistry())
    receiver = await start_receiver(recorder=TransferRecorder(metrics.kv_transfer, metrics.identity))
    s = sender(receiver)
    for rid, compression in (("a", "none"), ("b", "zstd")):
        f = frame(rid, compression=compression)
        receiver.expect(rid)
        await s.send(f)
        payload = await receiver.wait(rid, 5)
        assert all(torch.equal(k2, k[N - k2.shape[0]:]) and torch.equal(v2, v[N - v2.shape[0]:])
                   for (k, v), (k2, v2) in zip(KV, payload.layers, strict=True))
    assert s.num_attempts == 2  # one connection, reused
    labels = {**metrics.identity, "direction": "receive"}
    get = metrics.registry.get_sample_value
    assert get("ferry_kv_transfer_total", {**labels, "outcome": "success", "reason": "none"}) == 2
    assert get("ferry_kv_transfer_raw_bytes_total", labels) == 2 * LAYOUT.transfer_bytes(N)
    assert get("ferry_kv_transfer_wire_bytes_total", labels) == frame("a").wire_bytes + f.wire_bytes
    assert s.recorder.wire_bytes["send"] == frame("a").wire_bytes + f.wire_bytes
    await s.close()
    await receiver.close()


async def test_flipped_byte_is_rejected_and_the_next_frame_on_the_link_succeeds():
    receiver = await start_receiver()
    receiver.expect("req-1")
    data = bytearray(frame().to_bytes(SECRET))
    data[len(data) // 2] ^= 0x10
    assert await send_raw(receiver.port, bytes(data)) == "checksum"
    s = sender(receiver)
    await s.send(frame())
    assert (await receiver.wait("req-1", 5)).num_tokens == N
    assert receiver.recorder.failures("receive") == {"checksum": 1}
    await s.close()
    await receiver.close()


async def test_wrong_key_fails_at_once_without_retry():
    receiver = await start_receiver()
    receiver.expect("req-1")
    s = sender(receiver, link_secret=b"not-the-link-secret-000")
    with pytest.raises(AuthenticationFailed):
        await s.send(frame())
    assert s.num_attempts == 1
    assert receiver.recorder.failures("receive") == {"auth": 1}
    assert s.recorder.failures("send") == {"auth": 1}
    with pytest.raises(Timeout):
        await receiver.wait("req-1", 0.1)  # an unauthenticated frame never fails a waiting request early
    await receiver.close()


async def test_kv_of_another_version_fails_the_waiting_request_immediately():
    receiver = await start_receiver()
    receiver.expect("req-1")
    s = sender(receiver)
    with pytest.raises(WrongWeights):
        await s.send(frame(model_version_id="v2"))
    with pytest.raises(WrongWeights):
        await receiver.wait("req-1", 30)
    assert receiver.recorder.failures("receive") == {"version_mismatch": 1}
    await s.close()
    await receiver.close()


async def test_truncated_frame_and_other_protocol_version_are_counted():
    receiver = await start_receiver()
    data = frame().to_bytes(SECRET)
    _, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
    writer.write(data[: len(data) // 2])
    await writer.drain()
    writer.close()
    other_version = bytearray(data)
    other_version[8:10] = (7).to_bytes(2, "big")
    assert await send_raw(receiver.port, bytes(other_version)) == "protocol"
    await asyncio.sleep(0.05)
    assert receiver.recorder.failures("receive") == {"truncated": 1, "protocol": 1}
    await receiver.close()


async def test_sender_killed_mid_send_neither_hangs_the_decode_side_nor_blocks_the_next_request(tmp_path):
    receiver = await start_receiver()
    receiver.expect("req-1")
    path = tmp_path / "frame.bin"
    path.write_bytes(frame().to_bytes(SECRET))
    script = textwrap.dedent(f"""
        import os, signal, socket
        data = open({str(path)!r}, "rb").read()
        sock = socket.create_connection(("127.0.0.1", {receiver.port}))
        sock.sendall(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await proc.wait() == -9
    with pytest.raises(Timeout):
        await receiver.wait("req-1", 1.0)
    assert receiver.recorder.failures("receive") == {"truncated": 1, "timeout": 1}
    receiver.expect("req-2")
    s = sender(receiver)
    await s.send(frame("req-2"))
    assert (await receiver.wait("req-2", 5)).request_id == "req-2"
    await s.close()
    await receiver.close()


async def test_stalled_sender_is_dropped_after_the_read_timeout():
    receiver = await start_receiver(read_timeout_s=0.2)
    data = frame().to_bytes(SECRET)
    reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
    writer.write(data[:1000])
    await writer.drain()
    length = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 5), "big")
    assert b'"reason": "timeout"' in await reader.readexactly(length)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the receiver closed the connection
    assert receiver.recorder.failures("receive") == {"timeout": 1}
    writer.close()
    await receiver.close()


def small_frame(request_id):
    return encode_kv(request_id=request_id, model_version_id="v1", weights_sha256=WEIGHTS, layout=LAYOUT,
                     num_tokens=10, kv=[(k[:10], v[:10]) for k, v in KV])


@pytest.mark.parametrize("rejection", ["capacity", "protocol", "late"])
async def test_the_frame_after_a_rejection_is_delivered_at_once(rejection):
    """A rejected frame's connection is not reused: after a preamble it refuses, the receiver drops the
    rest of that stream, and reusing it stalled the next frame until the I/O timeout (then a retry)."""
    ok = small_frame("ok")
    receiver = await start_receiver(max_payload_bytes=ok.payload_bytes)
    s = sender(receiver, io_timeout_s=5.0)
    if rejection == "capacity":
        bad, error = frame("bad"), PayloadTooLarge
    elif rejection == "protocol":
        other = small_frame("bad")
        bad, error = dataclasses.replace(other, prefix=other.prefix[:8] + b"\x00\x07" + other.prefix[10:]), \
            ProtocolVersionMismatch
    else:
        with pytest.raises(Timeout):
            await receiver.wait("bad", 0.01)
        bad, error = small_frame("bad"), LatePayload
    with pytest.raises(error):
        await s.send(bad)
    receiver.expect("ok")
    seconds = await s.send(ok)
    assert (await receiver.wait("ok", 5)).num_tokens == 10
    assert seconds < 2.0 and s.num_attempts == 2 and s.num_failed_attempts == 1
    assert receiver.recorder.failures("receive") == ({rejection: 1} if rejection != "late" else
                                                     {"timeout": 1, "late": 1})
    await s.close()
    await receiver.close()


async def test_receiver_that_never_acks_times_out_the_sender_after_bounded_retries():
    async def black_hole(reader, writer):
        await reader.read()

    server = await asyncio.start_server(black_hole, "127.0.0.1", 0)
    s = KVSender("127.0.0.1", server.sockets[0].getsockname()[1], link_secret=SECRET, io_timeout_s=0.2,
                 max_attempts=2, backoff_s=0.01)
    with pytest.raises(Timeout):
        await s.send(frame())
    assert s.num_attempts == 2
    assert s.recorder.failures("send") == {"timeout": 1}
    server.close()


async def test_unreachable_receiver_is_retried_then_reported():
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = KVSender("127.0.0.1", port, link_secret=SECRET, max_attempts=3, backoff_s=0.01)
    with pytest.raises(ConnectionFailed):
        await s.send(frame())
    assert s.num_attempts == 3 and s.recorder.failures("send") == {"connection": 1}


async def test_retry_succeeds_once_the_receiver_is_up():
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = KVSender("127.0.0.1", port, link_secret=SECRET, max_attempts=3, backoff_s=0.3)
    task = asyncio.create_task(s.send(frame()))
    while s.num_failed_attempts < 1:  # the first attempt was refused, not merely started
        await asyncio.sleep(0.005)
    receiver = await start_receiver(port=port)
    receiver.expect("req-1")
    await task
    assert s.num_attempts == 2 and (await receiver.wait("req-1", 5)).num_tokens == N
    await s.close()
    await receiver.close()


async def test_late_and_unexpected_payloads_are_rejected_and_counted():
    receiver = await start_receiver()
    with pytest.raises(Timeout):
        await receiver.wait("req-1", 0.05)
    s = sender(receiver)
    with pytest.raises(LatePayload):
        await s.send(frame("req-1"))
    with pytest.raises(UnexpectedPayload):
        await s.send(frame("nobody-asked"))
    assert s.num_attempts == 2
    assert receiver.recorder.failures("receive") == {"timeout": 1, "late": 1, "unexpected": 1}
    await s.close()
    await receiver.close()


async def test_tls_link(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, env={**os.environ, "RANDFILE": "/dev/null"})
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    receiver = await start_receiver(ssl=server_ctx)
    receiver.expect("req-1")
    s = sender(receiver, ssl=client_ctx, server_hostname="localhost")
    await s.send(frame(compression="zstd"))
    payload = await receiver.wait("req-1", 5)
    assert torch.equal(payload.layers[5][0], KV[5][0])
    await s.close()
    await receiver.close()
