"""A real KV receiver in its own process, for memory measurements (``python -m`` this module).

Usage: ``python -m inference_worker.tests.support.kv_receiver SECRET_HEX MAX_NUM_TOKENS [REQUEST_ID ...]``.
It serves a :class:`~inference_worker.kv_transfer.receiver.KVReceiver` for Gemma 3 270M's KV layout
(18 layers, 5 sliding (W=512) : 1 full, 1 KV head of 256, bfloat16) on a free loopback port, expects
the given request ids, prints ``port <N>`` once listening, and when its stdin closes prints one JSON line
(``dropped`` and ``failures`` by reason, ``delivered`` request ids) and exits.
"""

from __future__ import annotations

import asyncio
import json
import sys

from inference_worker.kv_transfer.layout import KVLayout
from inference_worker.kv_transfer.receiver import KVReceiver

GEMMA_LAYOUT = KVLayout(tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18)), 1, 256, "bfloat16")
WEIGHTS = "ab" * 32


async def main(secret: bytes, max_num_tokens: int, request_ids: list[str]) -> None:
    receiver = await KVReceiver(link_secret=secret, model_version_id="v1", weights_sha256=WEIGHTS,
                                layout=GEMMA_LAYOUT, max_num_tokens=max_num_tokens, read_timeout_s=5.0).start()
    waits = [asyncio.ensure_future(receiver.wait(rid, 3600)) for rid in request_ids]
    print(f"port {receiver.port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    delivered = [w.result().request_id for w in waits if w.done() and not w.exception()]
    for w in waits:
        w.cancel()
    print(json.dumps({"dropped": dict(receiver.recorder.dropped), "failures": receiver.recorder.failures("receive"),
                      "delivered": delivered}), flush=True)
    await receiver.close()


if __name__ == "__main__":
    asyncio.run(main(bytes.fromhex(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
