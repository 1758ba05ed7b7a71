"""Cache-aware routing benchmark (issue 18, acceptance 1): least-loaded vs cache-aware vs round-robin, one run.

Fleet: one prefill and two decode ``gemma-3-270m`` workers (``--role prefill|decode``, one KV link secret,
prefix caching on) behind the real router (``python -m inference_worker router``), the decode pool in
datacenter ``dc1``, the prefill pool in ``dc2``, joined by a ``--link-gbps`` / ``--rtt-ms`` link; the PD
decision is the router's cost function with ``--decode-prefill-tokens-per-s`` and ``--prefill-tokens-per-s``
(both 1000 by default: one kind of CPU worker, so remote prefill wins only where the prefill replica holds
more of the prompt than the decode replica by more than the transfer costs). The workers stay up for the whole run; before each
policy every worker's prefix cache is reset (``POST /admin/kv-cache/reset``, signed with the link secret)
and a new router starts with ``--policy``. A last run, ``single``, routes the same workload to one decode
replica alone (cache-aware): the reference for "hit tokens >= 90% of one replica alone".

Workload (``bench/workloads.py``): ``--num-sessions`` multi-turn sessions (default 16 x 6 turns, a shared
system prompt, appended user tokens, answers appended), sessions arriving as a Poisson process at
``--session-rate`` per second (default 0.5) in the workload's random order, all of them live at once
(``--concurrency 16``), and the user's think time before every later turn (``--think-time-s``, exponential,
mean 4 s by default; :func:`bench.workloads.think_times`). Why think time: real chat sessions interleave, a
user reads an answer and types the next message (tens of seconds to minutes for a 100-token message), so
when a session's next turn arrives its previous replica is no less loaded than the other; back-to-back
turns (think time 0, the former default) hand least-loaded an affinity no real traffic has (the replica
that just answered is the one with a request fewer in flight). The default mean is shorter than a human's
to keep the bench short; what matters is that it exceeds the service time, so on a loaded host pass a
longer one. KV cache per worker ``--kv-cache-memory`` (default 512 MiB: about 14,500 tokens of Gemma 3 270M
float32 KV, more than the whole workload, so no run evicts: ``ferry_prefix_cache_evictions_total`` is
reported and the comparison is about placement only, not rigged by a cache too small for least-loaded).

Reported per policy: hit tokens (the workers' ``cached_tokens``), prefill tokens computed (prompt - hit),
TTFT p50/p90 (client side), throughput (output tokens per wall second), remote-prefill share (router
decisions), evictions and the router's predicted vs reported cached tokens; ratios least-loaded /
cache-aware and cache-aware hit tokens / single. Prints a table and writes ``bench/results/routing.json``.

Seen (2026-12-01, a 2-core host shared with seven other engineers' test runs, load average 9-13 during
the runs; TTFT is dominated by CPU starvation and differs run to run by more than the policies do):

- back-to-back turns (think time 0; 3 and 6 turns, 8 output tokens): least-loaded computed only 1.04x and
  1.11x the prefill tokens of cache-aware; cache-aware's hits 98.6% and 100.4% of one replica alone.
- think time 20 s, 5 turns, 200-token system prompt, 50..150 user tokens, 16 output tokens (old scorer, 512
  tokens per in-flight request): least-loaded 13605 prefill tokens, cache-aware 12693 (1.07x); TTFT p50
  15.1 s vs 17.1 s (queues of 4+ per worker: the host served 0.2 requests/s).
- ``--num-turns 6 --system-tokens 100 --user-tokens 16 48 --output-tokens 8 --think-time-s 15
  --session-rate 1``, the new scorer (pending prefill tokens, ``router/scoring.py``): prefill tokens least-loaded 6706,
  cache-aware 5730 (1.17x), round-robin 6706 (least-loaded with idle replicas breaks ties to the replica
  given fewer requests: it is round-robin), one replica alone 3938; hit tokens cache-aware 16112 of 21842
  = 90.0% of one replica alone (17904); TTFT p50 least-loaded 4.9 s, cache-aware 11.8 s, round-robin
  8.3 s, single 19.4 s (host noise, not the policies); no evictions; index predicted 15056 vs reported
  16112 cached tokens.

Acceptance 1 (1.5x fewer prefill tokens, 1.3x lower TTFT p50) was *not* reached on this host: the
workloads that fit in a shared 2-core run have short histories (a miss costs at most the ~250 tokens of a
session's history, the system prompt is cached everywhere), and with workers this starved the service
time approaches the think time, which brings back the back-to-back affinity. A quiet host (or a GPU) with
longer histories (``--num-turns 8 --user-tokens 100 300``) is where the figure should be measured.

    .venv/bin/python bench/routing.py [--num-sessions 16] [--num-turns 6] [--session-rate 0.5] [--think-time-s 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multi_turn import record  # noqa: E402
from bench.serve_load import percentile, run_sessions  # noqa: E402
from bench.workloads import IdealPrefixCache, MultiTurnConfig, MultiTurnWorkload  # noqa: E402
from inference_worker import http_headers  # noqa: E402
from inference_worker.model.prepare import read_manifest  # noqa: E402
from inference_worker.registry import model_cache_dir  # noqa: E402
from inference_worker.server.pd import sign  # noqa: E402
from inference_worker.tests.support.router import RouterProcess  # noqa: E402
from inference_worker.tests.support.worker import WorkerProcess, start_together  # noqa: E402
from inference_worker.tokenization import load_tokenizer  # noqa: E402

SECRET = "bench-routing-link-secret-0123456789"
POLICIES = ("least_loaded", "cache_aware", "round_robin")
WORKER_METRIC = re.compile(r"^(ferry_prompt_tokens_total|ferry_prefix_cache_hits_total|ferry_prefix_cache_evictions_total)(\{[^}]*\})? ([0-9.eE+-]+)$")
ROUTER_METRIC = re.compile(r'^ferry_router_(decisions_total|predicted_cached_tokens_total|reported_cached_tokens_total)'
                           r'\{([^}]*)\} ([0-9.eE+-]+)$')


def model_entry(model: str, block_size: int) -> dict:
    directory = model_cache_dir() / model
    config = json.loads((directory / "config.json").read_text())
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return {"layer_types": layer_types, "sliding_window": config.get("sliding_window") or 0,
            "num_kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"], "dtype": "float32",
            "model": model, "tokenizer": model, "weights_sha256": read_manifest(directory)["sha256"],
            "kv_dtype": "float32", "block_size": block_size}


def routing_table(args: argparse.Namespace, decode: list[WorkerProcess], prefill: WorkerProcess) -> dict:
    length = {"decode_prefill_tokens_per_s": args.decode_prefill_tokens_per_s}
    if args.prefill_tokens_per_s:
        length["prefill_tokens_per_s"] = args.prefill_tokens_per_s
    return {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
            "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1", "replicas": [
                          {"name": f"decode-{i}", "url": w.base_url, "track": "stable"} for i, w in enumerate(decode)]},
                      {"name": "prefill", "role": "prefill", "datacenter": "dc2", "replicas": [
                          {"name": "prefill-0", "url": prefill.base_url, "track": "stable"}]}],
            "links": [{"source": "dc2", "target": "dc1", "bandwidth_gbps": args.link_gbps, "rtt_ms": args.rtt_ms}],
            "length_routing": length, "models": {"v1": model_entry(args.model, args.block_size)}}


def reset_caches(workers: list[WorkerProcess]) -> None:
    body = b"{}"
    for w in workers:
        r = httpx.post(w.base_url + "/admin/kv-cache/reset", content=body, timeout=30,
                       headers={http_headers.KV_SIGNATURE: sign(SECRET.encode(), body),
                                "content-type": "application/json"})
        r.raise_for_status()


def router_metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = ROUTER_METRIC.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = m.group(1) + (":" + labels["decision"] if "decision" in labels else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def worker_tokens(workers: list[WorkerProcess]) -> dict[str, float]:
    """Sum over workers of prompt tokens prefilled and prefix-cache hit tokens (their own counters)."""
    out: dict[str, float] = {}
    for w in workers:
        for line in httpx.get(w.base_url + "/metrics", timeout=10).text.splitlines():
            m = WORKER_METRIC.match(line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def session_moves(records: list[dict]) -> dict[str, int]:
    """Placement of later turns: ``later_turns`` (turns 1.. of every session), ``moved`` (served by another decode
    replica than the session's previous turn: its history there is cold or stale) and ``remote`` (remote prefill)."""
    by_session: dict[str, list[dict]] = {}
    for r in records:
        by_session.setdefault(r["session_id"], []).append(r)
    later = moved = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        for prev, cur in zip(turns, turns[1:], strict=False):
            later += 1
            moved += cur["replica"] != prev["replica"]
    remote = sum(r["decision"] == "remote_prefill" for r in records)
    return {"later_turns": later, "moved": moved, "remote": remote}


def placement_bounds(workload: MultiTurnWorkload, block_size: int, num_replicas: int = 2, seed: int = 0) -> dict:
    """Prefill tokens of the workload on ``num_replicas`` unlimited caches (:class:`bench.workloads.IdealPrefixCache`
    each, requests in :meth:`~bench.workloads.MultiTurnWorkload.planned_requests` order) for two placements:
    ``sticky`` (every turn of a session on the replica of its first turn, sessions dealt round-robin) and ``random``
    (each turn on a replica drawn uniformly: what a load-only policy does to a session among equally loaded
    replicas). Host-independent: ``random / sticky`` is about the most prefill tokens cache affinity can save on
    this workload, since a moved turn still hits its history up to its last visit to that replica."""
    rng = random.Random(seed)
    out = {}
    for placement in ("sticky", "random"):
        caches = [IdealPrefixCache(block_size) for _ in range(num_replicas)]
        home = {s.session_id: i % num_replicas for i, s in enumerate(workload.sessions)}
        computed = 0
        for session, _, prompt, answer in workload.planned_requests():
            cache = caches[home[session.session_id] if placement == "sticky" else rng.randrange(num_replicas)]
            computed += len(prompt) - cache.num_cached_tokens(prompt)
            cache.store(prompt + answer[:-1])
        out[f"{placement}_prefill_tokens"] = computed
    out["random_over_sticky"] = out["random_prefill_tokens"] / max(out["sticky_prefill_tokens"], 1)
    return out


def run_policy(name: str, policy: str, table: dict, args: argparse.Namespace, workload: MultiTurnWorkload,
               workers: list[WorkerProcess], tmp: Path) -> dict:
    reset_caches(workers)
    path = tmp / f"table-{name}.json"
    path.write_text(json.dumps(table))
    router = RouterProcess(path, "--policy", policy, "--scrape-interval", "0.5")
    url = router.url
    try:
        time.sleep(1.0)  # the index subscribes to every replica's KV events (snapshots of the empty caches)
        tokenizer = load_tokenizer(model_cache_dir() / args.model)
        before = worker_tokens(workers)
        turns, wall_s = asyncio.run(run_sessions(
            url, args.model, workload, concurrency=args.concurrency, session_rate=args.session_rate, seed=args.seed,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False).ids, timeout_s=args.timeout_s,
            think_time_s=args.think_time_s))
        metrics = router_metrics(url)
        after = worker_tokens(workers)
    finally:
        router.stop()
    failed = [t for t in turns if not t.result.ok]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} turns failed, first: {failed[0].result.error}")
    records = [record(t) for t in turns]
    ttft = [r["ttft_s"] for r in records]
    decisions = {k.split(":", 1)[1]: v for k, v in metrics.items() if k.startswith("decisions_total:")}
    summary = {
        "policy": name, "num_requests": len(records),
        "num_prompt_tokens": sum(r["num_prompt_tokens"] for r in records),
        "hit_tokens": sum(r["num_cached_tokens"] for r in records),
        "prefill_tokens": sum(r["num_computed_tokens"] for r in records),
        "ttft_ms_p50": percentile(ttft, 50) * 1e3, "ttft_ms_p90": percentile(ttft, 90) * 1e3,
        "output_tokens_per_s": sum(r["num_output_tokens"] for r in records) / wall_s, "wall_s": wall_s,
        "remote_prefill_share": decisions.get("remote_prefill", 0.0) / max(sum(decisions.values()), 1.0),
        "decisions": decisions, "placement": session_moves(records),
        "load_avg_1m": os.getloadavg()[0], "worker_metrics_delta": {k: after[k] - before.get(k, 0.0) for k in after},
        "predicted_cached_tokens": metrics.get("predicted_cached_tokens_total", 0.0),
        "reported_cached_tokens": metrics.get("reported_cached_tokens_total", 0.0),
    }
    print(json.dumps(summary), flush=True)
    return {**summary, "requests": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--num-sessions", type=int, default=16)
    parser.add_argument("--num-turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, nargs=2, default=[50, 150], metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--session-rate", type=float, default=0.5, help="session arrivals per second (Poisson)")
    parser.add_argument("--think-time-s", type=float, default=4.0,
                        help="mean user think time before each later turn of a session (exponential; 0: back to back)")
    parser.add_argument("--concurrency", type=int, default=16, help="sessions in flight at most")
    parser.add_argument("--kv-cache-memory", default="512MiB", help="KV cache per worker")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--link-gbps", type=float, default=1.0)
    parser.add_argument("--rtt-ms", type=float, default=5.0)
    parser.add_argument("--decode-prefill-tokens-per-s", type=float, default=1000.0)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=1000.0,
                        help="the prefill pool's speed (same hardware as decode here); 0: not charged")
    parser.add_argument("--policies", default=",".join((*POLICIES, "single")),
                        help="comma-separated runs, in this order (least_loaded and cache_aware give the ratios)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "routing.json")
    args = parser.parse_args()
    config = MultiTurnConfig(num_sessions=args.num_sessions, num_turns=args.num_turns,
                             num_system_tokens=args.system_tokens, user_tokens=tuple(args.user_tokens),
                             max_tokens=args.output_tokens, seed=args.seed)
    workload = MultiTurnWorkload.from_config(config)
    common = ["--kv-link-secret", SECRET, "--block-size", str(args.block_size), "--kv-cache-memory", args.kv_cache_memory,
              "--max-num-seqs", "4"]
    prefill = WorkerProcess("--role", "prefill", *common, "--replica", "prefill-0", model=args.model)
    decode = [WorkerProcess("--role", "decode", *common, "--replica", f"decode-{i}", model=args.model) for i in range(2)]
    started = time.perf_counter()
    tmp = ROOT / "var" / "bench-routing"
    tmp.mkdir(parents=True, exist_ok=True)
    start_together(prefill, *decode)
    try:
        table = routing_table(args, decode, prefill)
        single = routing_table(args, decode[:1], prefill)
        runs = [run_policy(p, "cache_aware", single, args, workload, [prefill, *decode], tmp) if p == "single"
                else run_policy(p, p, table, args, workload, [prefill, *decode], tmp) for p in args.policies.split(",")]
    finally:
        for w in (prefill, *decode):
            w.stop()
    by = {r["policy"]: r for r in runs}
    ratios = {}
    if "least_loaded" in by and "cache_aware" in by:
        ll, ca = by["least_loaded"], by["cache_aware"]
        ratios["prefill_tokens_least_loaded_over_cache_aware"] = ll["prefill_tokens"] / max(ca["prefill_tokens"], 1)
        ratios["ttft_p50_least_loaded_over_cache_aware"] = ll["ttft_ms_p50"] / ca["ttft_ms_p50"]
    if "cache_aware" in by and "single" in by:
        ratios["hit_tokens_cache_aware_over_single"] = by["cache_aware"]["hit_tokens"] / max(by["single"]["hit_tokens"], 1)
    ratios["ideal_prefill_tokens"] = workload.ideal_prefill_tokens(args.block_size, args.concurrency)
    ratios["placement_bounds"] = placement_bounds(workload, args.block_size, seed=args.seed)
    cols = ("policy", "num_requests", "hit_tokens", "prefill_tokens", "ttft_ms_p50", "ttft_ms_p90",
            "output_tokens_per_s", "remote_prefill_share", "predicted_cached_tokens", "reported_cached_tokens")
    print("  ".join(f"{c:>14}" for c in cols))
    for r in runs:
        print("  ".join(f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
    print(json.dumps(ratios, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host": platform.node(), "cpu_count": os.cpu_count(), "args": {
        k: str(v) for k, v in vars(args).items()}, "config": vars(config), "bench_wall_s": time.perf_counter() - started,
        "ratios": ratios, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
