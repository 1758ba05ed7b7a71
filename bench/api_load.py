"""Open-loop HTTP load against Ferry's web process: latency percentiles and errors at fixed request rates.

Open loop: request ``i`` of a step is sent at ``t0 + i / rate`` whether or not earlier ones have answered,
and its latency counts from that scheduled time (a slow server is not given a slower offered load:
no coordinated omission). Each step reports offered and achieved rate, status counts, errors (non-2xx/304,
timeouts, connection errors) and latency percentiles (nearest-rank) in milliseconds.

A step is *held* when its p99 is under ``--p99-ms`` and it has 0 errors; the JSON's ``highest_held_rate`` is
the highest held rate of the run. ``--reference-path`` (default ``/healthz``) is loaded at the first rate in
the same run: the cost of the server path without Django views, the database and auth.

``--etag`` sends ``If-None-Match`` with the ETag of a first GET (the routing table: what a current router
sends; answers are 304).

    python bench/api_load.py --base-url http://127.0.0.1:8000 --token "$TOKEN" \\
        --path /api/v1/pools/ --rates 25,50,100,150,200 --duration-s 60 --out var/bench/api_load.json

Needs a running web process (``make run``); the client runs on the same machine unless pointed elsewhere,
so on a small machine it takes CPU from the server: say so with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..100) of ascending ``sorted_values``; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def server_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and all their descendants (the web supervisor and its workers)."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


async def run_step(session: aiohttp.ClientSession, url: str, *, rate: float, duration_s: float, headers: dict,
                   timeout_s: float, server_pids: list[int] = ()) -> dict:
    """Send ``rate * duration_s`` GETs to ``url`` on an open-loop schedule; the step's figures as a dict.

    With ``server_pids`` the step also reports the server's CPU use (``server_cpu_percent_of_machine``: CPU
    seconds of those processes and their children over the step, divided by the step's wall time and the
    machine's cores; ``server_cpu_ms_per_request``: those CPU milliseconds per answered request). Every step
    reports this load generator's own CPU (``client_cpu_percent_of_machine``) and the whole machine's busy share
    (``machine_busy_percent``: 100 minus idle and iowait, every process, the database's included)."""
    cpu_start = server_cpu_s(server_pids)
    client = psutil.Process()
    client_start = sum(client.cpu_times()[:2])
    machine_start = psutil.cpu_times()
    num_requests = max(1, round(rate * duration_s))
    latencies_ms: list[float] = []
    statuses: Counter = Counter()
    errors: Counter = Counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one(scheduled: float) -> None:
        try:
            async with session.get(url, headers=headers, timeout=timeout, allow_redirects=False) as response:
                await response.read()
                statuses[response.status] += 1
                if not (200 <= response.status < 300 or response.status == 304):
                    errors[f"http {response.status}"] += 1
        except TimeoutError:
            errors["timeout"] += 1
        except aiohttp.ClientError as exc:
            errors[type(exc).__name__] += 1
        latencies_ms.append((time.perf_counter() - scheduled) * 1000)

    loop_start = time.perf_counter() + 0.05
    tasks = []
    for i in range(num_requests):
        scheduled = loop_start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    elapsed_s = time.perf_counter() - loop_start
    cpu_s = server_cpu_s(server_pids) - cpu_start
    client_s = sum(client.cpu_times()[:2]) - client_start
    machine_end = psutil.cpu_times()
    machine_total = sum(machine_end) - sum(machine_start)
    machine_idle = (machine_end.idle - machine_start.idle) + (getattr(machine_end, "iowait", 0.0)
                                                               - getattr(machine_start, "iowait", 0.0))
    latencies_ms.sort()
    answered = sum(statuses.values())
    return {
        "server_cpu_percent_of_machine": round(100 * cpu_s / elapsed_s / (os.cpu_count() or 1), 1)
        if server_pids else None,
        "server_cpu_ms_per_request": round(1000 * cpu_s / answered, 2) if server_pids and answered else None,
        "client_cpu_percent_of_machine": round(100 * client_s / elapsed_s / (os.cpu_count() or 1), 1),
        "machine_busy_percent": round(100 * (1 - machine_idle / machine_total), 1) if machine_total > 0 else None,
        "offered_rate": rate, "num_requests": num_requests, "duration_s": round(elapsed_s, 3),
        "achieved_rate": round(answered / elapsed_s, 2),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "errors": dict(errors), "num_errors": sum(errors.values()),
        "latency_ms": {f"p{q}": round(percentile(latencies_ms, q), 2) for q in (50, 90, 99)}
        | {"max": round(latencies_ms[-1], 2)},
    }


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"{args.auth_scheme} {args.token}"} if args.token else {}
    rates = [float(r) for r in args.rates.split(",")]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    result: dict = {"base_url": args.base_url, "duration_s": args.duration_s, "p99_ms": args.p99_ms,
                    "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg(), "host": platform.node(),
                    "paths": {}}
    async with aiohttp.ClientSession(connector=connector) as session:
        if args.reference_path:
            url = args.base_url + args.reference_path
            result["reference"] = {"path": args.reference_path,
                                   **await run_step(session, url, rate=rates[0], duration_s=args.duration_s,
                                                    headers={}, timeout_s=args.timeout_s)}
            print_step(args.reference_path, result["reference"])
        for path in args.path:
            url = args.base_url + path
            step_headers = dict(headers)
            if args.etag:
                async with session.get(url, headers=headers) as response:
                    await response.read()
                    if response.headers.get("ETag"):
                        step_headers["If-None-Match"] = response.headers["ETag"]
            steps = []
            for rate in rates:
                step = await run_step(session, url, rate=rate, duration_s=args.duration_s, headers=step_headers,
                                      timeout_s=args.timeout_s, server_pids=args.server_pid)
                step["held"] = step["num_errors"] == 0 and step["latency_ms"]["p99"] < args.p99_ms
                steps.append(step)
                print_step(path, step)
                if args.stop_after_miss and not step["held"]:
                    break
                await asyncio.sleep(args.pause_s)
            held = [s["offered_rate"] for s in steps if s["held"]]
            result["paths"][path] = {"steps": steps, "highest_held_rate": max(held) if held else None}
    result["loadavg_end"] = os.getloadavg()
    return result


def print_step(path: str, step: dict) -> None:
    lat = step["latency_ms"]
    print(f"{path:32s} offered {step['offered_rate']:7.1f}/s achieved {step['achieved_rate']:7.1f}/s "
          f"p50 {lat['p50']:8.1f} p90 {lat['p90']:8.1f} p99 {lat['p99']:8.1f} max {lat['max']:8.1f} ms "
          f"errors {step['num_errors']} {'held' if step.get('held') else ''}"
          + (f" server CPU {step['server_cpu_percent_of_machine']}% of machine "
             f"({step['server_cpu_ms_per_request']} ms/request)"
             if step.get("server_cpu_percent_of_machine") is not None else "")
          + f" client CPU {step['client_cpu_percent_of_machine']}% machine busy {step['machine_busy_percent']}%",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", default=os.environ.get("FERRY_TOKEN", ""),
                        help="API token (Authorization: Token ...; default FERRY_TOKEN)")
    parser.add_argument("--auth-scheme", default="Token",
                        help="Token (a user's API token) or Bearer (the service token, as routers send it)")
    parser.add_argument("--server-pid", type=int, action="append", default=[],
                        help="report this process's and its children's CPU use per step (repeatable)")
    parser.add_argument("--path", action="append", help="path to load (repeatable; default /api/v1/pools/)")
    parser.add_argument("--rates", default="25,50,100,150,200", help="comma-separated requests/s, one step each")
    parser.add_argument("--duration-s", type=float, default=60.0, help="seconds per step")
    parser.add_argument("--pause-s", type=float, default=2.0, help="idle seconds between steps")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-request timeout (counts as an error)")
    parser.add_argument("--p99-ms", type=float, default=100.0, help="a step is held below this p99 with 0 errors")
    parser.add_argument("--reference-path", default="/healthz", help="loaded at the first rate; '' to skip")
    parser.add_argument("--etag", action="store_true", help="send If-None-Match with a first GET's ETag")
    parser.add_argument("--stop-after-miss", action="store_true", help="stop a path at its first step not held")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    args.path = args.path or ["/api/v1/pools/"]
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if not args.out else f"wrote {args.out}")


if __name__ == "__main__":
    main()
