"""KV transfer benchmark: bytes vs theory, loopback throughput, compression, emulated WAN links.

For prompts of 1K, 4K and 8K tokens with KV shaped like Gemma 3 270M's (18 layers: 15 sliding
W=512 + 3 full, 1 KV head, head_dim 256, bf16):

- bytes sent (hybrid: N tokens per full layer, min(N, W-1) per sliding layer) vs the DESIGN planner
  formula (``inference_worker.config.kv_bytes``: resident KV, min(N, W)) and the all-full equivalent;
- loopback TCP transfer time and throughput with compression off and on (zstd level 1), with the
  receiver in its own process; time is measured from the first byte sent to the receiver's ack,
  so it includes sealing (keyed BLAKE3, protocol 2), verification and decoding to tensors. The
  receiver consumes each payload as a decode worker does (awaits it, then drops it, which frees its
  buffer); a receiver that kept every payload would land each frame in never-touched memory, whose
  page faults cost several times the transfer itself on this VM;
- a reference in the same run: the same raw bytes over plain loopback TCP (no framing, no MAC);
- single-core rates of the candidate MACs and checksum on the 8K payload (1 MiB updates): keyed
  BLAKE3 (protocol 2), HMAC-SHA256 and CRC-32 (protocol 1), the reason for protocol 2's choice;
- CPU seconds per transfer on each side (``/proc``), and the throughput the busier side's CPU allows:
  on a shared, loaded machine wall time mostly measures waiting for a core;
- the same transfer over an emulated 10 and 1 Gbit/s link (the sender's token bucket), vs the
  theoretical ``wire_bytes * 8 / bandwidth``.

The KV is ``random`` (normal samples; compresses like noise) unless ``--real-kv``: then Gemma 3 270M
prefills one 8K-token text once and each N takes the KV of the first N positions (causal: identical
to a prefill of N tokens). The ``kv`` column says which. Results: a table on stdout and JSON under
``bench/results/pd_transfer.json``.

    .venv/bin/python bench/pd_transfer.py [--real-kv] [--device cuda] [--repeats 9]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import blake3
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_worker.config import kv_bytes  # noqa: E402
from inference_worker.kv_transfer.layout import KVLayout  # noqa: E402
from inference_worker.kv_transfer.transport import KVReceiver, KVSender  # noqa: E402
from inference_worker.kv_transfer.wire import encode_kv  # noqa: E402

SECRET = b"bench-link-secret-0123456789"
WEIGHTS = "0" * 64
LAYOUT = KVLayout(tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18)), 1, 256, "bfloat16")
SIZES = (1024, 4096, 8192)


def random_kv(max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randn(max_tokens, 1, 256, generator=g).to(torch.bfloat16) for _ in range(2))
            for _ in range(LAYOUT.num_layers)]


def real_kv(max_tokens: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill Gemma 3 270M on ``max_tokens`` tokens of real text; per layer (K, V) ``[N, 1, 256]`` in bf16."""
    from inference_worker.model.loader import load_model
    from inference_worker.reference.contiguous_runner import ContiguousModelRunner

    loaded = load_model("gemma-3-270m", device=device)
    text = ""
    sources = sorted((ROOT / "inference_worker").rglob("*.py"))
    for path in sources:
        text += path.read_text()
        if len(text) > max_tokens * 8:
            break
    ids = loaded.tokenizer.encode(text).ids[:max_tokens]
    if len(ids) < max_tokens:
        raise RuntimeError(f"only {len(ids)} tokens of text available")
    runner = ContiguousModelRunner(loaded.model, max_num_seqs=1, max_model_len=max_tokens)
    slot = runner.allocate_slot()
    started = time.perf_counter()
    runner.prefill(slot, ids)
    print(f"real KV: prefill of {max_tokens} tokens on {device} took {time.perf_counter() - started:.1f}s")
    return [(runner.cache.k[i][slot, :max_tokens].to("cpu", torch.bfloat16).contiguous(),
             runner.cache.v[i][slot, :max_tokens].to("cpu", torch.bfloat16).contiguous())
            for i in range(LAYOUT.num_layers)]


def kv_for(kv_full, n):
    return [(k[:n], v[:n]) for k, v in kv_full]


def raw_sink(server: socket.socket) -> None:
    """Reference receiver: plain TCP, u64 length then bytes read into one buffer, 1-byte reply; no framing."""
    while True:
        conn, _ = server.accept()
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                n = int.from_bytes(head, "big")
                view, got = memoryview(np.empty(n, dtype=np.uint8)), 0
                while got < n:
                    got += conn.recv_into(view[got:])
                conn.sendall(b"k")


def raw_send(port: int, data: bytes, repeats: int) -> list[float]:
    """Reference sender: wall seconds per plain-TCP transfer of ``data`` (until the 1-byte reply)."""
    out = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(repeats):
            started = time.perf_counter()
            sock.sendall(len(data).to_bytes(8, "big"))
            sock.sendall(data)
            sock.recv(1)
            out.append(time.perf_counter() - started)
    return out


async def serve_receiver() -> None:
    """Child process: a receiver that expects bench-0..bench-9999 and consumes them in that order (each
    payload dropped once delivered, as the decode worker drops it after copying it into its cache), plus
    the raw TCP sink; prints both ports."""
    receiver = await KVReceiver(link_secret=SECRET, model_version_id="bench", weights_sha256=WEIGHTS,
                                layout=LAYOUT, read_timeout_s=30).start()
    for i in range(10000):
        receiver.expect(f"bench-{i}")

    async def consume() -> None:
        for i in range(10000):
            await receiver.wait(f"bench-{i}", 3600)

    sink = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_sink, args=(sink,), daemon=True).start()
    print(receiver.port, sink.getsockname()[1], flush=True)
    await consume()  # the parent kills this process when done
    await asyncio.Event().wait()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc; all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(port: int, frames, *, bandwidth_gbps=None, receiver_pid=None) -> tuple[list[float], float, float]:
    """Wall seconds per transfer, and CPU seconds per transfer of the sender and the receiver process."""
    sender = KVSender("127.0.0.1", port, link_secret=SECRET, bandwidth_gbps=bandwidth_gbps, io_timeout_s=60)
    cpu0, rcpu0 = time.process_time(), process_cpu_s(receiver_pid) if receiver_pid else 0.0
    seconds = [await sender.send(f) for f in frames]
    send_cpu = (time.process_time() - cpu0) / len(frames)
    recv_cpu = ((process_cpu_s(receiver_pid) - rcpu0) / len(frames)) if receiver_pid else float("nan")
    await sender.close()
    return seconds, send_cpu, recv_cpu


async def run(args) -> dict:
    torch.set_num_threads(max(1, args.threads))
    sizes = tuple(int(x) for x in args.sizes.split(","))
    kv_full = real_kv(max(sizes), args.device) if args.real_kv else random_kv(max(sizes))
    child = subprocess.Popen([sys.executable, __file__, "--serve-receiver"], stdout=subprocess.PIPE, text=True)
    port, sink_port = (int(x) for x in child.stdout.readline().split())
    counter = iter(range(10000))
    rows = []
    try:
        for n in sizes:
            kv = kv_for(kv_full, n)
            row = {"num_tokens": n, "kv": "real" if args.real_kv else "random",
                   "raw_bytes": LAYOUT.transfer_bytes(n),
                   "planner_hybrid_bytes": kv_bytes(n, num_full_layers=3, num_sliding_layers=15, sliding_window=512,
                                                    num_kv_heads=1, head_dim=256, dtype_bytes=2),
                   "all_full_bytes": LAYOUT.dense_bytes(n)}
            raw = b"".join(bytes(memoryview(t[t.shape[0] - r:].contiguous().view(-1).view(torch.uint8).numpy()))
                           for (k, v), r in zip(kv, LAYOUT.layer_tokens(n), strict=True) for t in (k, v))
            row["plain_tcp_s"] = statistics.median(await asyncio.to_thread(raw_send, sink_port, raw, args.repeats))
            row["plain_tcp_GBps"] = len(raw) / row["plain_tcp_s"] / 1e9
            for compression in ("none", "zstd"):
                def frames(count, compression=compression, kv=kv, n=n):
                    return [encode_kv(request_id=f"bench-{next(counter)}", model_version_id="bench",
                                      weights_sha256=WEIGHTS, layout=LAYOUT, num_tokens=n, kv=kv,
                                      compression=compression) for _ in range(count)]
                t0 = time.perf_counter()
                encoded = encode_kv(request_id="size-probe", model_version_id="bench", weights_sha256=WEIGHTS,
                                    layout=LAYOUT, num_tokens=n, kv=kv, compression=compression)
                encode_s = time.perf_counter() - t0
                wire = encoded.wire_bytes
                batch = frames(args.repeats)
                seconds, send_cpu, recv_cpu = await measure(port, batch, receiver_pid=child.pid)
                loop_s = statistics.median(seconds)
                row[compression] = {"wire_bytes": wire, "ratio": row["raw_bytes"] / encoded.payload_bytes,
                                    "encode_s": encode_s, "loopback_s": loop_s,
                                    "loopback_raw_GBps": row["raw_bytes"] / loop_s / 1e9,
                                    "vs_plain_tcp": row["plain_tcp_s"] / loop_s,
                                    "send_cpu_s": send_cpu, "receive_cpu_s": recv_cpu,
                                    "cpu_bound_raw_GBps": row["raw_bytes"] / max(send_cpu, recv_cpu) / 1e9}
                for gbps in (10.0, 1.0):
                    link_s = statistics.median((await measure(port, frames(max(1, args.repeats // 2)),
                                                              bandwidth_gbps=gbps))[0])
                    row[compression][f"link_{gbps:g}gbps_s"] = link_s
                    row[compression][f"link_{gbps:g}gbps_theory_s"] = wire * 8 / (gbps * 1e9)
            rows.append(row)
            last_raw = raw
    finally:
        child.kill()
        child.wait()
    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "torch": torch.__version__,
            "repeats": args.repeats, "hash_GBps": hash_rates(last_raw), "rows": rows}


def hash_rates(data: bytes, chunk: int = 1 << 20, repeats: int = 5) -> dict:
    """Single-core GB/s (best of ``repeats``) of each candidate over ``data`` fed in ``chunk``-byte updates."""
    view, key = memoryview(data), bytes(range(32))

    def run(make, update, finish) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            state = make()
            for i in range(0, len(view), chunk):
                state = update(state, view[i:i + chunk])
            finish(state)
            best = min(best, time.perf_counter() - started)
        return len(data) / best / 1e9

    def feed(h, b):
        h.update(b)
        return h

    return {
        "blake3_keyed": run(lambda: blake3.blake3(key=key), feed, lambda h: h.digest()),
        "hmac_sha256": run(lambda: hmac.new(key, digestmod=hashlib.sha256), feed, lambda h: h.digest()),
        "crc32": run(lambda: 0, lambda c, b: zlib.crc32(b, c), lambda c: c),
    }


def print_table(result: dict) -> None:
    rates = result["hash_GBps"]
    print(f"\nMAC/checksum, one core, 1 MiB updates: keyed BLAKE3 {rates['blake3_keyed']:.2f} GB/s (protocol 2), "
          f"HMAC-SHA256 {rates['hmac_sha256']:.2f} GB/s and CRC-32 {rates['crc32']:.2f} GB/s (protocol 1)")
    print(f"\nKV transfer, Gemma 3 270M shape (bf16), kv={result['rows'][0]['kv']}, median of "
          f"{result['repeats']} loopback transfers; {result['cpus']} CPUs, load average "
          f"{result['load_average'][0]:.1f}")
    print("GB/s: raw KV bytes / wall time (first byte sent .. ack). tcp GB/s: the same bytes over plain loopback "
          "TCP (reference, same run); x tcp: plain TCP time / Ferry transfer time. cpuGB/s: raw bytes / the busier side's CPU "
          "seconds per transfer (what the pipelined link sustains when each side has its cores).")
    head = (f"{'N':>5} {'raw MB':>8} {'planner MB':>10} {'all-full MB':>11} {'x smaller':>9} {'comp':>5} "
            f"{'wire MB':>8} {'ratio':>6} {'loop ms':>8} {'GB/s':>6} {'tcp GB/s':>8} {'x tcp':>5} {'cpuGB/s':>7} {'10G ms':>7} {'(th)':>6} {'1G ms':>7} {'(th)':>6}")
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        for c in ("none", "zstd"):
            m = r[c]
            print(f"{r['num_tokens']:>5} {r['raw_bytes'] / 1e6:>8.2f} {r['planner_hybrid_bytes'] / 1e6:>10.2f} "
                  f"{r['all_full_bytes'] / 1e6:>11.2f} {r['all_full_bytes'] / r['raw_bytes']:>9.2f} {c:>5} "
                  f"{m['wire_bytes'] / 1e6:>8.2f} {m['ratio']:>6.3f} {m['loopback_s'] * 1e3:>8.1f} "
                  f"{m['loopback_raw_GBps']:>6.2f} {r['plain_tcp_GBps']:>8.2f} {m['vs_plain_tcp']:>5.2f} "
                  f"{m['cpu_bound_raw_GBps']:>7.2f} {m['link_10gbps_s'] * 1e3:>7.1f} "
                  f"{m['link_10gbps_theory_s'] * 1e3:>6.1f} {m['link_1gbps_s'] * 1e3:>7.1f} "
                  f"{m['link_1gbps_theory_s'] * 1e3:>6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-kv", action="store_true", help="KV from a real Gemma 3 270M prefill")
    parser.add_argument("--device", default="cpu", help="device of the --real-kv prefill")
    parser.add_argument("--repeats", type=int, default=9, help="transfers per measurement (median reported)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt lengths, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd_transfer.json"))
    parser.add_argument("--serve-receiver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_receiver:
        asyncio.run(serve_receiver())
        return
    result = asyncio.run(run(args))
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
