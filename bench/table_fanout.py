"""Routing-table fan-out: how fast a table change reaches N routers that poll it, and what the polls cost the web.

N simulated routers (asyncio, one aiohttp session each, as many connections as a real router fleet would open) poll
``GET /api/v1/routing-table/`` every ``--interval-s`` (1 s, the router's default) with the service token and
``If-None-Match`` of the last ETag they saw, each at its own random phase — exactly what
:class:`inference_worker.router.source.TableSource` sends. ``--changes`` times, the bench changes the table through
the API (``PATCH /api/v1/cluster-links/{id}/`` alternating the link's ``rtt_ms``; the link is in the table) and records:

* ``publish_s``: PATCH sent -> the new version served (a watcher polls every 20 ms): the control plane's own
  latency to publish (reconcile's tick publishes link changes);
* per router, ``seen_s``: new version served -> that router's first 200 with it. The p50/p99/max over all routers
  and changes are the fan-out figures (issue 21's "a table change reaches all of them with p99 under 1 s").

The web processes' CPU over the steady polling is reported as a share of the machine (user+system CPU seconds of the
web supervisor and its workers / wall seconds / cores), with the same for the bench itself (it shares the machine).
Errors (non-200/304, timeouts) are counted per status. JSON to ``--out`` (default ``bench/results/table_fanout.json``).

    .venv/bin/python bench/table_fanout.py --token "$ADMIN_TOKEN" --routers 300 --changes 10

Needs ``make run``'s stack: the web URL, an admin API token (printed by ``make run``) and the service token
(``--var-dir``'s ``launcher_tokens.json``, or ``FERRY_SERVICE_TOKEN``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.api_load import percentile, server_cpu_s  # noqa: E402


def web_pids() -> list[int]:
    """PIDs of the web server's supervisor processes (``python -m controlplane.web``), children added by CPU sums."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any(part.endswith("controlplane.web") or part == "controlplane.web" for part in cmdline):
            found.append(proc.info["pid"])
    return found


class Router:
    """One simulated router: its last ETag and version, and when it first saw each version."""

    def __init__(self, index: int):
        self.index = index
        self.etag = ""
        self.version = 0
        self.seen_at: dict[int, float] = {}


async def poll_loop(router: Router, session: aiohttp.ClientSession, url: str, headers: dict, interval_s: float,
                    stop: asyncio.Event, statuses: Counter) -> None:
    await asyncio.sleep(random.uniform(0, interval_s))  # each router has its own phase
    while not stop.is_set():
        started = time.monotonic()
        request_headers = dict(headers)
        if router.etag:
            request_headers["If-None-Match"] = router.etag
        try:
            async with session.get(url, headers=request_headers) as response:
                statuses[response.status] += 1
                if response.status == 200:
                    body = await response.json()
                    router.etag = response.headers.get("ETag", "")
                    router.version = int(body["version"])
                    router.seen_at.setdefault(router.version, time.time())
                else:
                    await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            statuses[type(exc).__name__] += 1
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def current_version(session: aiohttp.ClientSession, url: str, headers: dict) -> int:
    async with session.get(url, headers=headers) as response:
        response.raise_for_status()
        return int((await response.json())["version"])


async def run(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    table_url = f"{base}/api/v1/routing-table/"
    service = {"Authorization": f"Bearer {args.service_token}"}
    admin = {"Authorization": f"Token {args.token}"}
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as control:
        async with control.get(f"{base}/api/v1/cluster-links/", headers=admin) as response:
            response.raise_for_status()
            links = (await response.json())["results"]
        if not links:
            raise SystemExit("the fleet has no ClusterLink to change (make run's demo has two)")
        link = links[0]
        routers = [Router(i) for i in range(args.routers)]
        statuses: Counter = Counter()
        stop = asyncio.Event()
        sessions = [aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1))
                    for _ in routers]
        tasks = [asyncio.create_task(poll_loop(r, s, table_url, service, args.interval_s, stop, statuses))
                 for r, s in zip(routers, sessions, strict=True)]
        pids = args.server_pid or web_pids()
        changes = []
        try:
            await asyncio.sleep(args.warmup_s)
            cpu_web0, cpu_self0, wall0 = server_cpu_s(pids), server_cpu_s([os.getpid()]), time.monotonic()
            for change in range(args.changes):
                before = await current_version(control, table_url, service)
                rtt = float(link["rtt_ms"]) + (0.5 if change % 2 == 0 else 0.0)
                patched_at = time.time()
                async with control.patch(f"{base}/api/v1/cluster-links/{link['id']}/", json={"rtt_ms": rtt},
                                         headers=admin) as response:
                    if response.status != 200:
                        raise SystemExit(f"PATCH link: {response.status} {await response.text()}")
                published_at = None
                while published_at is None and time.time() - patched_at < args.publish_timeout_s:
                    if await current_version(control, table_url, service) > before:
                        published_at = time.time()
                    else:
                        await asyncio.sleep(0.02)
                if published_at is None:
                    raise SystemExit(f"change {change}: no new table version within {args.publish_timeout_s} s")
                version = await current_version(control, table_url, service)
                deadline = time.time() + args.settle_s
                while time.time() < deadline and not all(r.version >= version for r in routers):
                    await asyncio.sleep(0.05)
                seen = [r.seen_at[v] - published_at for r in routers for v in [min(
                    (x for x in r.seen_at if x >= version), default=None)] if v is not None]
                changes.append({"version": version, "publish_s": round(published_at - patched_at, 4),
                                "routers_seen": len(seen), "seen_s": sorted(round(s, 4) for s in seen)})
                print(f"change {change + 1}: v{version} published {published_at - patched_at:.3f} s after the PATCH; "
                      f"{len(seen)}/{len(routers)} routers saw it, p99 {percentile(sorted(seen), 99) or 0:.3f} s",
                      flush=True)
                await asyncio.sleep(random.uniform(0.5, 1.5))
            wall = time.monotonic() - wall0
            cpu_web, cpu_self = server_cpu_s(pids) - cpu_web0, server_cpu_s([os.getpid()]) - cpu_self0
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(s.close() for s in sessions))
    cores = psutil.cpu_count() or 1
    all_seen = sorted(s for c in changes for s in c["seen_s"])
    return {
        "routers": args.routers, "interval_s": args.interval_s, "changes": changes,
        "fanout_s": {"p50": percentile(all_seen, 50), "p99": percentile(all_seen, 99),
                     "max": all_seen[-1] if all_seen else None},
        "publish_s": {"p50": percentile(sorted(c["publish_s"] for c in changes), 50),
                      "max": max(c["publish_s"] for c in changes)},
        "missed": sum(args.routers - c["routers_seen"] for c in changes),
        "statuses": {str(k): v for k, v in statuses.items()},
        "web_cpu_share": round(cpu_web / wall / cores, 4) if pids else None, "web_pids": pids,
        "bench_cpu_share": round(cpu_self / wall / cores, 4), "cores": cores,
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", default=os.environ.get("FERRY_TOKEN", ""), help="an admin API token")
    parser.add_argument("--service-token", default=os.environ.get("FERRY_SERVICE_TOKEN", ""))
    parser.add_argument("--var-dir", type=Path, default=ROOT / "var",
                        help="make run's var/ (its launcher_tokens.json has the service token)")
    parser.add_argument("--routers", type=int, default=300)
    parser.add_argument("--interval-s", type=float, default=1.0, help="each router's poll period")
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=10.0, help="longest wait for every router after a change")
    parser.add_argument("--publish-timeout-s", type=float, default=30.0)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="per-request timeout (counted as an error)")
    parser.add_argument("--server-pid", type=int, action="append", default=[],
                        help="web supervisor PID (default: processes running controlplane.web)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "table_fanout.json")
    args = parser.parse_args(argv)
    if not args.service_token:
        tokens = args.var_dir / "launcher_tokens.json"
        if not tokens.exists():
            parser.error(f"no --service-token and no {tokens}")
        args.service_token = json.loads(tokens.read_text())["FERRY_SERVICE_TOKEN"]
    if not args.token:
        parser.error("--token (an admin API token, printed by make run) is required")
    result = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in result.items() if k != "changes"}, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
