"""Router and worker under abuse (issue 19, acceptance 2): ``/health`` of the router while it is attacked, and how
fast a worker stops working on a request whose client left. One run, real processes.

Fleet: one colocated ``gemma-3-270m`` worker (``--max-prompts 1000``) behind the real router
(``python -m inference_worker router --tokenizer <gemma>``: prompts are tokenized exactly, so a long prompt
costs the router real tokenizer work). A prober sends ``GET /health`` to the router every 10 ms throughout and
records each latency; each phase reports its probes' p50 / p99 / max and the p99 ratio against the idle phase
of the same run (the reference):

- ``idle``: nothing else (reference);
- ``6mb_prompt``: a 6 MB prompt, with ``Content-Length`` and chunked (expected: 413 before it is buffered);
- ``8_under_limit``: 8 concurrent prompts each 1 KiB under the body limit (text: the router and the worker
  tokenize them; expected 400 ``context_length_exceeded`` from the worker, the prompts being far over 32K
  tokens);
- ``100_slow_clients``: 100 connections that send headers and then dribble their bodies one byte every 0.5 s
  (for ``--slow-seconds``); those over the per-client in-flight bound are refused (429) before their bodies
  are read;
- ``abandoned_batch``: a 1000-prompt batch (64 tokens each) whose client hangs up once the worker runs it;
  reported: seconds until the worker's engine has nothing running or waiting (its gauges are published every
  0.25 s, so the figure is an upper bound with that resolution).

Acceptance: router ``/health`` p99 < 50 ms in every phase; the worker idle within 1 s of the hang-up. Prints a
table and writes ``bench/results/router_abuse.json``.

Seen (2026-12-01, the 2-core host shared with other jobs, load average 20-29 during the runs; two runs):
``/health`` p99 idle 18.6 / 9.3 ms, 6 MB prompt 8.8 / 17.3 ms (both 413), 8 prompts under the limit 204 / 479 ms
(all 400 ``context_length_exceeded`` from the worker), 100 slow clients 44.6 / 72.4 ms (64 still being read, 36
refused 429), abandoned batch 136 / 124 ms; worker idle 0.64 / 1.25 s after the hang-up. The 50 ms p99 was not
met in the phases where the worker computes on the same two cores as the router.

    .venv/bin/python bench/router_abuse.py [--slow-seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_worker.request_limits import default_max_body_bytes  # noqa: E402
from inference_worker.tests.support.router import RouterProcess, send_and_hold  # noqa: E402
from inference_worker.tests.support.worker import WorkerProcess, gemma_tokenizer_dir  # noqa: E402

MODEL = "gemma-3-270m"
PROBE_INTERVAL_S = 0.01


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


class Prober:
    """``GET /health`` every 10 ms on its own connection; latencies in ms, grouped by the current phase."""

    def __init__(self, url: str):
        self.url, self.phase, self.samples = url, "idle", {}
        self.failures: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    ok = (await client.get(self.url + "/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                latency_ms = (time.perf_counter() - started) * 1000
                if ok:
                    self.samples.setdefault(self.phase, []).append(latency_ms)
                else:
                    self.failures[self.phase] = self.failures.get(self.phase, 0) + 1
                await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - latency_ms / 1000))


def words(num_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["ferry", "harbour", "crates", "apples", "island", "market", "tide", "captain", "rope", "gull",
             "lantern", "cargo", "north", "seven", "quay", "storm"]
    out, size = [], 0
    while size < num_bytes:
        w = rng.choice(vocab) + " "
        out.append(w)
        size += len(w)
    return "".join(out)[:num_bytes]


async def phase_6mb(url: str) -> dict:
    body = json.dumps({"model": MODEL, "prompt": "x" * 6_000_000, "max_tokens": 4}).encode()
    async with httpx.AsyncClient(timeout=60) as client:
        plain = await client.post(url + "/v1/completions", content=body)
        chunked = await client.post(url + "/v1/completions",
                                    content=_chunks(body, 65536))
    return {"statuses": [plain.status_code, chunked.status_code]}


async def _chunks(body: bytes, size: int):
    for i in range(0, len(body), size):
        yield body[i:i + size]


async def phase_under_limit(url: str, limit: int) -> dict:
    async def one(i: int) -> tuple[int, str]:
        envelope = json.dumps({"model": MODEL, "prompt": "", "max_tokens": 4}).encode()
        text = words(limit - 1024 - len(envelope), seed=i)
        async with httpx.AsyncClient(timeout=300) as client:
            r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4})
        code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
        return r.status_code, code

    results = await asyncio.gather(*(one(i) for i in range(8)))
    return {"statuses": [s for s, _ in results], "codes": sorted({c for _, c in results})}


async def phase_slow_clients(url: str, num_clients: int, seconds: float) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": "slow " * 20, "max_tokens": 4}).encode()

    async def one() -> int:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        await writer.drain()
        deadline = time.monotonic() + seconds
        sent = 0
        try:
            while time.monotonic() < deadline and sent < len(body) - 1:
                writer.write(body[sent:sent + 1])
                await writer.drain()
                sent += 1
                try:  # answered early (refused before the body was read)?
                    line = await asyncio.wait_for(reader.readline(), 0.5)
                    return int(line.split()[1]) if line else 0
                except TimeoutError:
                    pass
            return -1  # still being read when the phase ended
        except (ConnectionError, IndexError, ValueError):
            return 0
        finally:
            writer.close()

    statuses = await asyncio.gather(*(one() for _ in range(num_clients)))
    counts: dict[str, int] = {}
    for s in statuses:
        key = "still_reading" if s == -1 else ("closed" if s == 0 else str(s))
        counts[key] = counts.get(key, 0) + 1
    return {"outcomes": counts}


def worker_busy(worker_url: str) -> bool:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(worker_url + "/metrics", timeout=5).text):
        for s in family.samples:
            if s.name in ("ferry_num_requests_running", "ferry_num_requests_waiting"):
                total += s.value
    return total > 0


async def phase_abandoned_batch(url: str, worker_url: str) -> dict:
    body = {"model": MODEL, "prompt": [f"Crate {i} of the ferry holds" for i in range(1000)], "max_tokens": 64,
            "temperature": 0.0, "ignore_eos": True}
    sock = await asyncio.to_thread(send_and_hold, url, "/v1/completions", body)
    deadline = time.monotonic() + 120
    while not await asyncio.to_thread(worker_busy, worker_url):
        if time.monotonic() > deadline:
            raise RuntimeError("the batch never started on the worker")
        await asyncio.sleep(0.05)
    sock.close()
    left = time.monotonic()
    while await asyncio.to_thread(worker_busy, worker_url):
        if time.monotonic() - left > 60:
            break
        await asyncio.sleep(0.05)
    return {"worker_idle_after_s": round(time.monotonic() - left, 3)}


async def run(args: argparse.Namespace, router_url: str, worker_url: str) -> dict:
    prober = Prober(router_url)
    stop = asyncio.Event()
    probe = asyncio.create_task(prober.run(stop))
    limit = default_max_body_bytes(args.max_context_tokens)
    phases: dict[str, dict] = {}
    await asyncio.sleep(2.0)
    phases["idle"] = {}
    for name, coro in (("6mb_prompt", phase_6mb(router_url)),
                       ("8_under_limit", phase_under_limit(router_url, limit)),
                       ("100_slow_clients", phase_slow_clients(router_url, 100, args.slow_seconds)),
                       ("abandoned_batch", phase_abandoned_batch(router_url, worker_url))):
        prober.phase = name
        started = time.perf_counter()
        phases[name] = await coro
        phases[name]["seconds"] = round(time.perf_counter() - started, 2)
        print(name, json.dumps(phases[name]), flush=True)
    stop.set()
    await probe
    reference = percentile(prober.samples.get("idle", []), 99)
    for name, result in phases.items():
        lat = prober.samples.get(name, [])
        result.update(health_probes=len(lat), health_failures=prober.failures.get(name, 0),
                      health_p50_ms=round(percentile(lat, 50), 2), health_p99_ms=round(percentile(lat, 99), 2),
                      health_max_ms=round(max(lat), 2) if lat else None,
                      health_p99_vs_idle=round(percentile(lat, 99) / reference, 2) if lat else None)
    return {"body_limit_bytes": limit, "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-context-tokens", type=int, default=32768)
    parser.add_argument("--slow-seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router_abuse.json")
    args = parser.parse_args()
    tmp = ROOT / "var" / "bench-router-abuse"
    tmp.mkdir(parents=True, exist_ok=True)
    with WorkerProcess("--max-prompts", "1000", "--max-num-seqs", "8", "--kv-cache-memory", "256MiB") as worker:
        table = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
                 "pools": [{"name": "colocated", "role": "colocated", "datacenter": "dc1",
                            "replicas": [{"name": "w0", "url": worker.base_url, "track": "stable"}]}]}
        (tmp / "table.json").write_text(json.dumps(table))
        router = RouterProcess(tmp / "table.json", "--tokenizer", str(gemma_tokenizer_dir()), "--scrape-interval", "0",
                               "--max-context-tokens", str(args.max_context_tokens), "--max-prompts", "1000",
                               log_path=tmp / "router.log")
        try:
            result = asyncio.run(run(args, router.url, worker.base_url))
        finally:
            router.stop()
    phases = result["phases"]
    print(f"{'phase':18} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99/idle':>9}  outcome")
    for name, r in phases.items():
        outcome = {k: v for k, v in r.items() if not k.startswith("health_") and k != "seconds"}
        print(f"{name:18} {r['health_p50_ms']:8} {r['health_p99_ms']:8} {r['health_max_ms']:8} "
              f"{r['health_p99_vs_idle']:9}  {json.dumps(outcome)}")
    checks = {"health_p99_under_50ms": all(r["health_p99_ms"] < 50 for r in phases.values()),
              "worker_idle_within_1s": phases["abandoned_batch"]["worker_idle_after_s"] <= 1.0}
    print(json.dumps(checks))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host": platform.node(), "cpu_count": os.cpu_count(), "args": {
        "max_context_tokens": args.max_context_tokens, "slow_seconds": args.slow_seconds}, **result,
        "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
