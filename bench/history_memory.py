"""Embedded Redis RSS while the telemetry history fills and is read: glibc's malloc defaults vs Ferry's tunables.

Issue 20's soak (``bench/chaos.py --soak``) found the embedded Redis' RSS growing 8.6% between minute 5 and 30
while its data grew far less. This bench replays that load on two embedded servers side by side, one started
as ``make run`` starts it (:data:`apps.setup.embedded_redis.MALLOC_TUNABLES`) and one with glibc's defaults,
the same operations in the same order on both (so the ratio is what the allocator setting does):

- per simulated second, one record appended to each of ``--pools`` pool histories
  (:class:`apps.telemetry.history.SignalHistory`, the poller's call; records sealed into compressed chunks,
  thinned after 5 minutes and trimmed at the 15-minute horizon as in production);
- every ``--read-every-s`` simulated seconds, a read of every pool's whole history (``read_many``: what the
  autoscaler, the rollout gates and the pool page read).

Records: with ``--from-redis URL`` the history records of a running stack (``make run`` or the soak's Redis,
the real poll records, replayed in a loop with new times); else poller-shaped records with random values
rounded as the poller rounds them (:func:`apps.telemetry.poller.significant`). Simulated time, so 30 minutes
take about a minute. Reports RSS (``/proc/<pid>/status`` VmRSS) and ``used_memory`` at each simulated minute
and the growth between minute 5 and the end; JSON to ``bench/results/history_memory.json``.

    .venv/bin/python bench/history_memory.py [--minutes 30] [--from-redis redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
import zstandard  # noqa: E402

from apps.setup.embedded_redis import MALLOC_TUNABLES, start_embedded_redis  # noqa: E402
from apps.telemetry.history import SignalHistory  # noqa: E402
from apps.telemetry.poller import SIGNAL_PARTS, significant  # noqa: E402
from apps.telemetry.signals import SIGNAL_SPECS  # noqa: E402

T0 = 1_796_000_000.0


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (bytes), from ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def synthetic_records(pool_id: int, count: int, seed: int) -> list[dict]:
    """Poller-shaped records (every signal for the pool and one track, KV transfers), values rounded as polled."""
    rng = random.Random(seed * 1000 + pool_id)
    out = []
    for i in range(count):
        signals = {name: None if name.startswith("gpu_") else rng.random() * 50 for name in SIGNAL_SPECS}
        signals["ready_replicas"] = 1.0
        out.append({"type": "telemetry.signals", "seq": i + 1, "pool_id": pool_id, "at": T0 + i, "window_s": 30.0,
                    "source": "scrape", "signals": significant(signals), "tracks": {"stable": significant(signals)},
                    "kv_transfers": significant({"transfers": [{"direction": "send", "outcome": "success",
                                                                "reason": "none", "per_s": rng.random()}],
                                                 "wire_bytes_per_s": {"send": rng.random() * 3e6}}),
                    "ejections": {}})
    return out


def records_from_redis(url: str) -> list[list[dict]]:
    """Every pool history's records found in the Redis at ``url`` (chunks and recent list), one list per pool,
    :data:`~apps.telemetry.poller.SIGNAL_PARTS` rounded as the poller rounds them (a stack older than that
    rounding stored them at full precision)."""
    client = redis.Redis.from_url(url)
    pools = []
    for key in sorted(client.scan_iter(match="*telemetry:history:pool:*:chunks")):
        recent = key[: -len(b"chunks")] + b"recent"
        members = [m for blob in client.zrange(key, 0, -1)
                   for m in zstandard.ZstdDecompressor().decompress(blob).split(b"\n")]
        members += client.lrange(recent, 0, -1)
        records = [json.loads(m)[1] for m in members]
        pools.append([{k: significant(v) if k in SIGNAL_PARTS else v for k, v in r.items()} for r in records])
    if not pools:
        raise SystemExit(f"no telemetry history in {url}")
    return pools


def replay(records: list[list[dict]], *, tunables: bool, minutes: int, read_every_s: int) -> dict:
    """Run the simulated load on a fresh embedded Redis; per simulated minute its RSS and ``used_memory``."""
    with tempfile.TemporaryDirectory(prefix="ferry-history-memory-") as var_dir:
        server = start_embedded_redis(Path(var_dir), malloc_tunables=tunables)
        try:
            client = redis.Redis.from_url(server.url)
            history = SignalHistory(client, prefix="ferry:telemetry:")
            scopes = [f"pool:{i + 1}" for i in range(len(records))]
            samples = []
            started = time.monotonic()
            for t in range(minutes * 60 + 1):
                for scope, pool in zip(scopes, records, strict=True):
                    record = dict(pool[t % len(pool)], at=T0 + t)
                    history.append(scope, T0 + t, record)
                if t % read_every_s == 0:
                    history.read_many(scopes)
                if t % 60 == 0:
                    samples.append({"minute": t // 60, "rss_bytes": rss_bytes(server.process.pid),
                                    "used_memory": int(client.info("memory")["used_memory"]),
                                    "history_bytes": history.memory_bytes(scopes)})
            client.close()
        finally:
            server.stop()
    base, end = samples[min(5, minutes - 1)], samples[-1]
    return {"malloc_tunables": MALLOC_TUNABLES if tunables else None, "samples": samples,
            "rss_growth": (end["rss_bytes"] - base["rss_bytes"]) / base["rss_bytes"],
            "used_memory_growth": (end["used_memory"] - base["used_memory"]) / base["used_memory"],
            "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=int, default=30, help="simulated minutes (growth from minute 5)")
    parser.add_argument("--pools", type=int, default=2, help="pools (synthetic records only)")
    parser.add_argument("--read-every-s", type=int, default=5)
    parser.add_argument("--from-redis", default=None, metavar="URL", help="replay a running stack's history")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "history_memory.json")
    args = parser.parse_args()
    if args.minutes < 6:
        parser.error("--minutes must be at least 6 (growth is measured from minute 5)")
    records = (records_from_redis(args.from_redis) if args.from_redis
               else [synthetic_records(i + 1, 900, args.seed) for i in range(args.pools)])
    runs = {}
    for name, tunables in (("tunables", True), ("glibc_defaults", False)):
        runs[name] = replay(records, tunables=tunables, minutes=args.minutes, read_every_s=args.read_every_s)
        run = runs[name]
        base, end = run["samples"][5], run["samples"][-1]
        print(f"{name:15} RSS minute 5 {base['rss_bytes'] / 2**20:.2f} MiB -> {end['rss_bytes'] / 2**20:.2f} MiB "
              f"({100 * run['rss_growth']:+.1f}%), used_memory {base['used_memory'] / 2**20:.2f} -> "
              f"{end['used_memory'] / 2**20:.2f} MiB ({100 * run['used_memory_growth']:+.1f}%), "
              f"history {end['history_bytes'] / 2**10:.0f} KiB", flush=True)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "records": "from-redis" if args.from_redis
               else "synthetic", "records_per_pool": [len(r) for r in records], "runs": runs,
               "rss_growth_defaults_over_tunables": (runs["glibc_defaults"]["rss_growth"]
                                                     / runs["tunables"]["rss_growth"]
                                                     if runs["tunables"]["rss_growth"] > 0 else None)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
