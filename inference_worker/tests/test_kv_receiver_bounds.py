"""KV protocol 3 on the receiver: headers authenticated before the payload is read or allocated, sizes capped
by the model's KV geometry, lying connections dropped and counted, protocol 2 still accepted (one release)."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from inference_worker.kv_transfer.errors import LatePayload, PayloadTooLarge, WrongWeights
from inference_worker.kv_transfer.transport import KVReceiver, KVSender
from inference_worker.kv_transfer.wire import (
    MAGIC,
    PREAMBLE,
    LinkKey,
    encode_kv,
    max_payload_bytes,
)
from inference_worker.tests.support.kv_receiver import GEMMA_LAYOUT
from inference_worker.tests.test_kv_transfer_wire import SECRET, WEIGHTS, make_kv

torch.set_num_threads(1)
pytestmark = [pytest.mark.timeout(90)]
N = 40
KV = make_kv(GEMMA_LAYOUT, N)


def frame(request_id, protocol=3, model_version_id="v1", num_tokens=N, kv=KV, compression="none"):
    return encode_kv(request_id=request_id, model_version_id=model_version_id, weights_sha256=WEIGHTS,
                     layout=GEMMA_LAYOUT, num_tokens=num_tokens, kv=kv, protocol=protocol, compression=compression)


async def start_receiver(**kw):
    args = dict(link_secret=SECRET, model_version_id="v1", weights_sha256=WEIGHTS, layout=GEMMA_LAYOUT,
                max_num_tokens=4096, read_timeout_s=2.0)
    args.update(kw)
    return await KVReceiver(**args).start()


async def exchange(port, data):
    """Write ``data`` (ignoring a reset), then return (ack reason, True if the receiver closed the stream)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    length = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 5), "big")
    ack = json.loads(await reader.readexactly(length))
    closed = await asyncio.wait_for(reader.read(1), 5) == b""
    writer.close()
    return (None if ack["ok"] else ack["reason"]), closed


def forged_head(*, version=3, payload_len=1 << 20, header=None, key_id=None, tag=None):
    """Preamble + header (+ a protocol-3 tag) written by someone without the link secret."""
    body = json.dumps(header or {"request_id": "req-1", "model_version_id": "v1", "weights_sha256": WEIGHTS,
                                 "num_tokens": 1, "raw_bytes": 18432, "payload_bytes": payload_len,
                                 "compression": "none", "dtype": "bfloat16"}).encode()
    pre = PREAMBLE.pack(MAGIC, version, 0, len(body), payload_len, key_id or LinkKey(SECRET).key_id)
    return pre + body + ((tag or bytes(32)) if version == 3 else b"")


@pytest.mark.asyncio
async def test_decode_worker_accepts_protocol_2_and_protocol_3_prefill_workers():
    """Acceptance 6: one receiver of this release takes frames from an old (protocol 2) and a new sender."""
    receiver = await start_receiver()
    for rid in ("from-p2", "from-p3"):
        receiver.expect(rid)
    old, new = (KVSender("127.0.0.1", receiver.port, link_secret=SECRET) for _ in range(2))
    await old.send(frame("from-p2", protocol=2))
    await new.send(frame("from-p3", protocol=3))
    p2, p3 = await receiver.wait("from-p2", 5), await receiver.wait("from-p3", 5)
    for payload in (p2, p3):
        assert payload.num_tokens == N and torch.equal(payload.layers[5][0], KV[5][0])
    assert receiver.recorder.counts[("receive", "success", "none")] == 2 and not receiver.recorder.dropped
    await old.close(), await new.close()
    await receiver.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("case, reason", [
    ("forged_tag", "checksum"),          # names this link's key id, tag made without the secret
    ("other_key", "auth"),                # names another key id
    ("claims_8_gib", "capacity"),         # preamble over the geometry cap (4096 tokens of Gemma 3)
    ("protocol_2_unknown_request", "unexpected"),  # unauthenticated header naming no waiting request
    ("protocol_1", "protocol"),
    ("junk", "checksum"),                 # not a Ferry frame at all
])
async def test_a_lying_header_is_refused_before_any_payload_is_sent_and_the_connection_dropped(case, reason):
    """The head alone (no payload byte sent) gets its verdict; the receiver then closes the connection and
    counts the drop by reason. A waiting request is not failed by a forgery."""
    receiver = await start_receiver()
    receiver.expect("req-1")
    data = {
        "forged_tag": forged_head(),
        "other_key": forged_head(key_id=LinkKey(b"another-secret-0123456789").key_id),
        "claims_8_gib": forged_head(payload_len=8 << 30),
        "protocol_2_unknown_request": forged_head(version=2, header={"request_id": "guessed", "num_tokens": 1}),
        "protocol_1": forged_head(version=1),
        "junk": os.urandom(4096),
    }[case]
    assert await exchange(receiver.port, data) == (reason, True)
    assert receiver.recorder.dropped == {reason: 1}
    assert receiver.recorder.failures("receive") == {reason: 1}
    assert receiver.is_waiting("req-1")  # the forgery did not touch the pending request
    receiver.expect("req-1")
    sender = KVSender("127.0.0.1", receiver.port, link_secret=SECRET)
    await sender.send(frame("req-1"))  # the link still works
    assert (await receiver.wait("req-1", 5)).num_tokens == N
    await sender.close()
    await receiver.close()


def test_geometry_cap_is_the_models_kv_at_max_context():
    """Gemma 3 270M at 4096 tokens: b = 1024 B/token/layer; 3 full layers x 4096 + 15 sliding x 511."""
    raw = 1024 * (3 * 4096 + 15 * 511)
    assert GEMMA_LAYOUT.transfer_bytes(4096) == raw
    receiver = KVReceiver(link_secret=SECRET, model_version_id="v1", weights_sha256=WEIGHTS, layout=GEMMA_LAYOUT,
                          max_num_tokens=4096)
    assert receiver.max_frame_payload_bytes == max_payload_bytes(raw) == raw + raw // 256 + 64


@pytest.mark.asyncio
async def test_authentic_frames_refused_by_their_header_keep_the_connection_and_the_reason():
    """A protocol-3 header that verifies but names another model version, a given-up request, or more tokens
    than the worker's context is refused by its header; the sender gets the exact reason, the pending
    request learns of the wrong weights at once, and the payload is read past (never allocated)."""
    receiver = await start_receiver(max_num_tokens=64)
    sender = KVSender("127.0.0.1", receiver.port, link_secret=SECRET, max_attempts=1)
    receiver.expect("req-1")
    with pytest.raises(WrongWeights):
        await sender.send(frame("req-1", model_version_id="v0"))
    with pytest.raises(WrongWeights):
        await receiver.wait("req-1", 1)
    with pytest.raises(LatePayload):
        await sender.send(frame("req-1"))
    receiver.expect("long")  # zeros compress under the byte cap: the header's token count decides
    zeros = [(torch.zeros(65, 1, 256, dtype=torch.bfloat16),) * 2 for _ in range(18)]
    with pytest.raises(PayloadTooLarge, match="65 tokens exceeds this worker's context of 64"):
        await sender.send(frame("long", num_tokens=65, kv=zeros, compression="zstd"))
    assert receiver.recorder.failures("receive") == {"version_mismatch": 1, "late": 1, "capacity": 1}
    assert receiver.recorder.dropped == {}
    with pytest.raises(PayloadTooLarge, match="exceeds the limit"):  # over the byte cap: the preamble decides
        await sender.send(frame("long", num_tokens=65, kv=make_kv(GEMMA_LAYOUT, 65)))
    assert receiver.recorder.dropped == {"capacity": 1}
    receiver.expect("ok")
    await sender.send(frame("ok"))
    assert (await receiver.wait("ok", 5)).request_id == "ok"
    await sender.close()
    await receiver.close()


def _rss_peak_kib(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0])


def _blast(port: int, head: bytes, total_bytes: int) -> int:
    """Send ``head`` then junk up to ``total_bytes`` until the receiver drops the connection; bytes sent."""
    junk = os.urandom(1 << 20)
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        try:
            sock.sendall(head)
            sent = len(head)
            while sent < total_bytes:
                sock.sendall(junk)
                sent += len(junk)
        except (BrokenPipeError, ConnectionResetError):
            return sent
    raise AssertionError(f"the receiver took all {sent} bytes without dropping the connection")


def test_one_gib_of_junk_and_an_8_gib_claim_raise_the_receivers_rss_by_less_than_16_mib():
    """Acceptance 3, on a real receiver in its own process (RSS peak from /proc: VmHWM, reset first with
    ``clear_refs`` 5). Each lie is followed by up to 1 GiB of junk; the receiver must drop the connection."""
    proc = subprocess.Popen([sys.executable, "-m", "inference_worker.tests.support.kv_receiver", SECRET.hex(), "32768",
                             "req-waiting"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])
        time.sleep(0.2)
        with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        baseline = _rss_peak_kib(proc.pid)
        cap = max_payload_bytes(GEMMA_LAYOUT.transfer_bytes(32768))
        heads = {
            "junk": b"",
            "claims_8_gib": forged_head(payload_len=8 << 30),
            "v3_forged_header_at_the_cap": forged_head(payload_len=cap),
            "v2_header_guessing_a_request_at_the_cap": forged_head(version=2, payload_len=cap,
                                                                   header={"request_id": "req-1", "num_tokens": 32768}),
            "v2_claims_1_gib": forged_head(version=2, payload_len=1 << 30),
        }
        sent = {name: _blast(port, head, 1 << 30) for name, head in heads.items()}
        growth_mib = (_rss_peak_kib(proc.pid) - baseline) / 1024
        proc.stdin.close()
        stats = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert growth_mib < 16, f"peak RSS grew by {growth_mib:.1f} MiB (bytes sent per case: {sent})"
    assert sum(stats["dropped"].values()) == len(heads), stats
    assert stats["dropped"] == {"checksum": 2, "capacity": 2, "unexpected": 1}, stats
