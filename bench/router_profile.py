"""Where the router's CPU goes per request (issue 18, acceptance 5): CPU per answered request, optionally a profile.

A real router process (``python -m inference_worker router``, ``cache_aware`` with or without the prefix index)
in front of two of ``bench/router_overhead.py``'s fast upstream replicas (aiohttp, a real prefix cache and KV
events), driven by a *closed loop* of ``--concurrency`` aiohttp clients sending ``--requests`` requests per case
after ``--warmup`` unrecorded ones. A closed loop measures cost, not latency: the router is never offered more
than it can take, so its CPU per request (``/proc/<pid>/stat``, user + system, every thread) is what one request
costs, not what queueing on a busy host adds. Cases as in ``router_overhead.py``: ``serve_load`` (8..64 words,
about 10..80 tokens) and ``4k`` (about 4096 tokens).

``--profile`` runs the router under ``cProfile`` (its main thread: the event loop; work the router hands to its
prompt thread pool shows as the wait for it) and prints the functions with the most own time and the most
cumulative time, both per request. Profile one case at a time (``--cases serve_load``): the figures are divided by
every request the router answered (warm-up included).

    .venv/bin/python bench/router_profile.py [--cases serve_load,4k] [--requests 1000] [--concurrency 8]
        [--no-kv-index] [--profile] [--top 30]

Prints one line per case; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multi_turn import worker_cpu_s  # noqa: E402
from bench.router_overhead import post_completion, prompts_of_about, start_upstreams, stop_upstreams  # noqa: E402
from bench.serve_load import percentile  # noqa: E402
from bench.workloads import word_prompts  # noqa: E402
from inference_worker.tests.support.agent import wait_for  # noqa: E402
from inference_worker.tests.support.worker import free_port  # noqa: E402


async def closed_loop(url: str, bodies: list[bytes], num_requests: int, concurrency: int) -> tuple[list[float], int]:
    """Send ``num_requests`` bodies (round robin) with ``concurrency`` requests in flight at all times.

    Returns:
        (latencies in s of the answered requests, number of failed requests).
    """
    latencies: list[float] = []
    errors = 0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def client() -> None:
            nonlocal next_index, errors
            while next_index < num_requests:
                body = bodies[next_index % len(bodies)]
                next_index += 1
                start = time.perf_counter()
                if await post_completion(session, url, body):
                    latencies.append(time.perf_counter() - start)
                else:
                    errors += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, errors


def router_command(port: int, table: Path, args: argparse.Namespace, profile_path: Path | None) -> list[str]:
    command = [sys.executable]
    if profile_path is not None:
        command += ["-m", "cProfile", "-o", str(profile_path)]
    command += ["-m", "inference_worker", "router", "--port", str(port), "--routing-table", str(table), "--no-auth",
                "--log-level", args.log_level, "--policy", "cache_aware", "--max-in-flight", "4096",
                "--max-in-flight-per-key", "4096", "--no-breaker"]
    if args.no_kv_index:
        command.append("--no-kv-index")
    return command


def print_profile(path: Path, num_requests: int, top: int) -> None:
    """The ``top`` functions by own time and by cumulative time, in ms per request."""
    stats = pstats.Stats(str(path))
    rows = [(func, cc, nc, tt, ct) for func, (cc, nc, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
    total = sum(r[3] for r in rows)
    print(f"profile: {total * 1e3 / num_requests:.3f} ms of main-thread CPU per request ({num_requests} requests)")
    for title, key in (("own time", 3), ("cumulative", 4)):
        print(f"--- top {top} by {title} (ms per request, calls per request)")
        for func, _, nc, tt, ct in sorted(rows, key=lambda r: r[key], reverse=True)[:top]:
            file, line, name = func
            where = f"{Path(file).name}:{line}({name})" if line else name
            print(f"{tt * 1e3 / num_requests:8.4f} own {ct * 1e3 / num_requests:8.4f} cum {nc / num_requests:7.2f}x  "
                  f"{where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--capacity-blocks", type=int, default=65536)
    parser.add_argument("--cases", default="serve_load,4k")
    parser.add_argument("--requests", type=int, default=1000, help="recorded requests per case")
    parser.add_argument("--warmup", type=int, default=200,
                        help="unrecorded requests per case first (the first ones wait for the router to load the "
                             "tokenizer: on a host at load average 60 that took the client's 60 s timeout)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-distinct", type=int, default=128, help="distinct prompts per case")
    parser.add_argument("--no-kv-index", action="store_true", help="the router without the prefix index")
    parser.add_argument("--profile", action="store_true", help="run the router under cProfile")
    parser.add_argument("--log-level", default="warning", help="the router's (info: an access log line per request)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args()

    from bench.routing import model_entry
    from inference_worker.registry import model_cache_dir
    from inference_worker.tokenization import load_tokenizer

    tokenizer = load_tokenizer(model_cache_dir() / args.model)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=True).ids

    cases = {"serve_load": lambda: [r.prompt for r in word_prompts(args.num_distinct, args.seed, (8, 64), (8, 32))],
             "4k": lambda: prompts_of_about(4096, min(args.num_distinct, 64), args.seed, encode)}
    tmp = ROOT / "var" / "bench-router-profile"
    tmp.mkdir(parents=True, exist_ok=True)
    upstream_args = argparse.Namespace(model=args.model, block_size=args.block_size,
                                       capacity_blocks=args.capacity_blocks, ready_timeout_s=args.ready_timeout_s)
    upstreams = start_upstreams([f"decode-{i}" for i in range(2)], upstream_args)
    table = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
             "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1", "replicas": [
                 {"name": f"decode-{i}", "url": url, "track": "stable"} for i, (_, url) in enumerate(upstreams)]}],
             "models": {"v1": model_entry(args.model, args.block_size)}}
    table_path = tmp / "table.json"
    table_path.write_text(json.dumps(table))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    profile_path = tmp / "router.prof" if args.profile else None
    log = open(tmp / "router.log", "wb")  # noqa: SIM115 - closed in finally
    router = subprocess.Popen(router_command(port, table_path, args, profile_path), cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT)
    results = []
    answered = 0
    try:
        import httpx

        def ready() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_for(ready, args.ready_timeout_s, 0.2):
            raise RuntimeError(f"router not ready within {args.ready_timeout_s} s")
        time.sleep(1.0)  # the index subscribes to both replicas' KV events
        for name in args.cases.split(","):
            prompts = cases[name]()
            bodies = [json.dumps({"model": args.model, "prompt": p, "max_tokens": 1}).encode() for p in prompts]
            warm, warm_errors = asyncio.run(closed_loop(url, bodies, args.warmup, args.concurrency))
            pids = {"router": router.pid, **{f"upstream-{i}": p.pid for i, (p, _) in enumerate(upstreams)}}
            cpu_before = {k: worker_cpu_s(pid) for k, pid in pids.items()}
            client_before, wall_before = time.process_time(), time.perf_counter()
            latencies, errors = asyncio.run(closed_loop(url, bodies, args.requests, args.concurrency))
            wall = time.perf_counter() - wall_before
            cpu = {k: (worker_cpu_s(pid) - cpu_before[k]) * 1e3 / max(len(latencies), 1) for k, pid in pids.items()}
            cpu["client"] = (time.process_time() - client_before) * 1e3 / max(len(latencies), 1)
            answered += len(warm) + len(latencies)
            lengths = [len(encode(p)) for p in prompts]
            result = {"case": name, "kv_index": not args.no_kv_index, "num_requests": len(latencies),
                      "errors": errors, "warmup_errors": warm_errors, "concurrency": args.concurrency,
                      "rate_rps": len(latencies) / wall, "router_cpu_ms_per_request": cpu["router"],
                      "upstreams_cpu_ms_per_request": cpu["upstream-0"] + cpu["upstream-1"],
                      "client_cpu_ms_per_request": cpu["client"],
                      "p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
                      "prompt_tokens_min_mean_max": [min(lengths), sum(lengths) / len(lengths), max(lengths)],
                      "load_avg_1m": os.getloadavg()[0], "profiled": args.profile, "log_level": args.log_level,
                      "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")}
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        # uvicorn re-raises the signal it stopped on: SIGTERM then kills the process before cProfile writes its file;
        # SIGINT raises KeyboardInterrupt, past which cProfile still writes it
        router.send_signal(signal.SIGINT if profile_path is not None else signal.SIGTERM)
        try:
            router.wait(60)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(5)
        log.close()
        stop_upstreams(upstreams)
    for r in results:
        print(f"{r['case']:>10} index {'on ' if r['kv_index'] else 'off'} {r['num_requests']:6d} requests "
              f"{r['rate_rps']:7.1f}/s  CPU ms/request: router {r['router_cpu_ms_per_request']:.3f}, upstreams "
              f"{r['upstreams_cpu_ms_per_request']:.3f}, client {r['client_cpu_ms_per_request']:.3f}  "
              f"p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms  errors {r['errors']}")
    if profile_path is not None and profile_path.exists():
        print_profile(profile_path, max(answered, 1), args.top)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu_count": os.cpu_count(), "args": {k: str(v) for k, v in
                                                                                vars(args).items()},
                                        "cases": results}, indent=1))


if __name__ == "__main__":
    main()
