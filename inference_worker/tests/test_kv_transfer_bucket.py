"""Per-link bandwidth cap: the token bucket's accounting, alone and driving a real TCP transfer."""

import asyncio
import time

import pytest
import torch

from inference_worker.kv_transfer.bucket import TokenBucket
from inference_worker.kv_transfer.layout import KVLayout
from inference_worker.kv_transfer.transport import KVSender
from inference_worker.kv_transfer.wire import encode_kv
from inference_worker.tests.test_kv_transfer_transport import frame, start_receiver
from inference_worker.tests.test_kv_transfer_wire import SECRET, WEIGHTS, make_kv


class VirtualClock:
    """Time that advances only when the bucket sleeps (then yields to the event loop)."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def __call__(self):
        return self.now

    async def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_bucket_waits_exactly_for_the_bytes_beyond_the_burst():
    clock = VirtualClock()
    bucket = TokenBucket.for_link(1.0, burst_bytes=1 << 20, clock=clock, sleep=clock.sleep)  # 125e6 B/s
    for _ in range(100):
        await bucket.acquire(1 << 20)
    assert bucket.total_tokens == 100 * (1 << 20)
    assert bucket.num_waits == 99
    assert bucket.total_wait_s == pytest.approx(99 * (1 << 20) / 125e6, rel=1e-12)
    assert clock.now == pytest.approx(bucket.total_wait_s, rel=1e-12)


def test_try_acquire_reports_when_tokens_will_be_there():
    clock = VirtualClock()
    bucket = TokenBucket(2.0, 3.0, clock=clock)  # 2 requests/s, burst 3
    assert [bucket.try_acquire() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.try_acquire() == pytest.approx(0.5)
    clock.now = 0.5
    assert bucket.try_acquire() == 0.0
    assert bucket.try_acquire(4) == float("inf")
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("gbps", [1.0, 10.0])
async def test_link_cap_paces_a_real_transfer(gbps):
    clock = VirtualClock()
    receiver = await start_receiver()
    receiver.expect("req-1")
    burst = 1 << 16
    bucket = TokenBucket.for_link(gbps, burst_bytes=burst, clock=clock, sleep=clock.sleep)
    sender = KVSender("127.0.0.1", receiver.port, link_secret=SECRET, bucket=bucket, chunk_bytes=burst)
    f = frame()
    await sender.send(f)
    assert (await receiver.wait("req-1", 5)).num_tokens == 600
    # Every byte of the frame passed through the bucket; the waits add up to its time on a gbps link.
    assert bucket.total_tokens == f.wire_bytes
    assert bucket.total_wait_s == pytest.approx((f.wire_bytes - burst) / (gbps * 1e9 / 8), rel=1e-9)
    await sender.close()
    await receiver.close()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_waiting_for_the_link_cap_is_not_an_io_timeout():
    """Chunks wait ~0.15 s each for the bucket, longer than the 0.05 s I/O timeout: still one clean attempt."""
    layout = KVLayout((None,), 1, 256, "bfloat16")  # one full layer: K and V of 300 KiB each at N=600
    kv = make_kv(layout, 600)
    f = encode_kv(request_id="req-1", model_version_id="v1", weights_sha256=WEIGHTS, layout=layout, num_tokens=600,
                  kv=kv)
    receiver = await start_receiver(layout=layout)
    receiver.expect("req-1")
    chunk = 1 << 17
    bucket = TokenBucket(rate_per_s=chunk / 0.15, burst=chunk)
    sender = KVSender("127.0.0.1", receiver.port, link_secret=SECRET, bucket=bucket, chunk_bytes=chunk,
                      io_timeout_s=0.05, max_attempts=1)
    started = time.monotonic()
    await sender.send(f)
    elapsed = time.monotonic() - started
    assert torch.equal((await receiver.wait("req-1", 5)).layers[0][1], kv[0][1])
    assert sender.num_attempts == 1 and bucket.total_tokens == f.wire_bytes
    # The cap holds whatever the load: (wire bytes - burst) / rate = 0.55 s at least.
    assert elapsed >= (f.wire_bytes - chunk) / bucket.rate_per_s
    # Most of it was spent waiting for the bucket, many I/O timeouts' worth. Not all: time the sender spends
    # encoding and writing refills the bucket too, and on a loaded machine that is more (CI: 0.499 s of 0.55).
    assert bucket.total_wait_s > 5 * 0.05
    await sender.close()
    await receiver.close()
