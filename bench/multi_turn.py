"""Multi-turn benchmark: prefix caching off vs on in one run (issue 16, item 6 and acceptance 3).

Workload (``bench/workloads.py``, :class:`~bench.workloads.MultiTurnConfig` defaults): 8 sessions x 6 turns,
a 300-token system prompt shared by every session, 100..300 appended user tokens per turn, 32 output tokens
per turn (greedy, ``ignore_eos``); each turn's prompt is the previous prompt, the previous answer's token ids
and the new user tokens. Closed loop: 4 sessions in flight, a session's turns one after another, sessions
started in the workload's random order. Every request carries the session header (``X-Ferry-Sticky-Key``).

For each mode this script starts its own ``python -m inference_worker serve --model gemma-3-270m`` on a free
loopback port with default flags (``off`` adds ``--no-prefix-caching``, but only when ``serve --help`` lists
it: before the engine has prefix caching both modes run the same worker and the ratios are ~1.0), sends one
warm-up request that shares no prefix with the workload, runs the workload and stops the worker.

Answers: the previous answer is appended as the token ids the server returned when it returns them
(``return_token_ids``); otherwise the returned text is re-encoded with the model's tokenizer, which need
not give back the generated ids (seen: 1 of the 8 first-turn answers of seed 0 re-encodes to other ids of
the same length, so the next turn can hit only up to that point; ``answers.length_mismatches`` counts the
re-encodings whose length differs from ``completion_tokens``). Reported per mode:

* prefill tokens computed = ``usage.prompt_tokens`` - cached tokens (``usage.prompt_tokens_details.
  cached_tokens``, else the ``X-Ferry-Cached-Tokens`` header, else 0), summed over requests; the deltas of
  the worker's ``ferry_prompt_tokens*`` and ``ferry_prefix_cache*`` metrics next to it;
* TTFT p50/p90 (client side: time to the first streamed chunk with text or token ids), end-to-end p50/p90,
  wall time and the worker process's CPU seconds (``/proc``: the work done, whatever else shares the
  machine); the ratios off / on. On a shared machine latencies move by tens of percent between identical
  runs: ``--repeats N`` runs each mode N times, alternating off/on and on/off;
* KV events (issue 16 item 4): one client subscribes to the worker's ``GET /v1/kv-events`` for the whole
  run (:class:`KVEventsSubscriber`), so events are really streamed; events, batches and bytes received
  client-side over the run and per second of wall time, next to the worker's ``ferry_kv_events*`` deltas;
* the ideal: tokens an unlimited prefix cache (:class:`~bench.workloads.IdealPrefixCache`, block size 16 as
  the engine's default unless ``--block-size``) would still compute, from the workload alone and from this
  run's actual prompts and timing (a request sees only KV computed before it was sent). Neither is a
  floor for what the engine computes: the engine looks a request's hit up when it *admits* it,
  and registers a prompt's blocks at the end of the step that computed them, so of the first wave (4
  sessions sent at once) the requests that arrive while the first one's prefill step runs are admitted
  after it and hit its system-prompt blocks. ``computed_tokens_admitted_one_by_one`` (the ideal with
  admissions one after another) is the floor for that case (seed 0, block size 16: 10480 of 53344 tokens,
  5.09x, against 11344, 4.70x, when the first wave shares nothing).

Prints a table and writes ``bench/results/multi_turn.json``.

``--tiers`` (issue 17, acceptance 4) runs four scenarios on the same workload instead and compares turns
4-6: caching off; a warm worker (all turns on one worker); turns 1-3 on a worker with a disk tier
(``--kv-offload-disk``), that worker restarted, turns 4-6 (the disk tier); turns 1-3 on worker A and turns
4-6 on a worker B that never saw the sessions, both on one shared directory (``--kv-shared``). Writes
``bench/results/multi_turn_tiers.json``. One run (2026-12-01, default workload, 2 shared CPUs at load average
11-18 from other work, so latencies are noisy): turns 4-6 had 35516 prompt tokens; cached warm 30608, restart
(disk) 30672 (100.2% of warm), second worker (shared) 30672 (100.2%); TTFT p50 off 28599 ms, warm 5957 ms
(4.80x), restart 5310 ms (5.39x), second worker 14069 ms (2.03x; its phase ran at the highest load).

    .venv/bin/python bench/multi_turn.py [--concurrency 4] [--seed 0] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_load import TurnResult, percentile, run_sessions  # noqa: E402
from bench.workloads import MultiTurnConfig, MultiTurnWorkload, ideal_prefill_tokens_of_run  # noqa: E402
from inference_worker.registry import model_cache_dir  # noqa: E402
from inference_worker.tests.support.worker import WorkerProcess  # noqa: E402
from inference_worker.tokenization import load_tokenizer  # noqa: E402

ENGINE_DEFAULT_BLOCK_SIZE = 16  # PagedLLMEngine's block_size default (inference_worker/engine/paged_engine.py)
WORKER_METRICS = re.compile(r"^(ferry_prompt_tokens\w*|ferry_prefix_cache\w*|ferry_kv_events\w*|ferry_kv_tier\w*)(\{[^}]*\})? "
                            r"([0-9.eE+-]+)$")
KV_EVENTS_PATH = "/v1/kv-events"  # inference_worker.server.kv_cache_routes.KV_EVENTS_PATH (that module imports torch)


class KVEventsSubscriber:
    """One client of the worker's ``GET /v1/kv-events`` stream, read in a thread for the whole run, so the
    worker really streams its KV events (its ``ferry_kv_events_sent*`` counters count only events sent to a
    subscriber) and the bench measures them client-side too.

    :meth:`counts` gives (batches, events, bytes) received so far; bytes are the NDJSON lines with their
    newlines. The first batch is the snapshot on connect (:meth:`wait_snapshot`); the stream ends when
    the worker stops (``error`` then says how). ``transport``: httpx's (tests give a mock server).
    """

    def __init__(self, base_url: str, transport: httpx.BaseTransport | None = None) -> None:
        self._url = base_url + KV_EVENTS_PATH
        self._transport = transport
        self._lock = threading.Lock()
        self._batches = self._events = self._bytes = 0
        self._snapshot = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._read, name="kv-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with httpx.Client(transport=self._transport, timeout=httpx.Timeout(30.0, read=None)) as client, \
                    client.stream("GET", self._url) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line:
                        continue
                    batch = json.loads(line)
                    with self._lock:
                        self._batches += 1
                        self._events += len(batch["events"])
                        self._bytes += len(line.encode()) + 1
                    self._snapshot.set()
        except (httpx.HTTPError, json.JSONDecodeError) as exc:  # the worker stopping ends the stream
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._snapshot.set()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the stream to end."""
        self._thread.join(timeout_s)

    def wait_snapshot(self, timeout_s: float = 60.0) -> None:
        """Wait for the first batch (the snapshot on connect).

        Raises:
            RuntimeError: none came within ``timeout_s`` seconds or the stream failed first.
        """
        if not self._snapshot.wait(timeout_s) or self.counts()[0] == 0:
            raise RuntimeError(f"no KV events snapshot from {self._url}: {self.error or 'timed out'}")

    def counts(self) -> tuple[int, int, int]:
        with self._lock:
            return self._batches, self._events, self._bytes


def serve_options() -> set[str]:
    """The ``--options`` that ``python -m inference_worker serve --help`` lists."""
    help_text = subprocess.run([sys.executable, "-m", "inference_worker", "serve", "--help"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=120).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))


def worker_metrics(base_url: str) -> dict[str, float]:
    """Sum over label sets of the worker's prompt-token and prefix-cache samples (``_created`` left out)."""
    totals: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        match = WORKER_METRICS.match(line)
        if match and not match.group(1).endswith("_created"):
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


def record(turn: TurnResult) -> dict:
    result = turn.result
    return {"session_id": turn.session_id, "turn": turn.turn, "num_prompt_tokens_sent": len(turn.prompt),
            "num_prompt_tokens": result.num_prompt_tokens, "num_cached_tokens": result.num_cached_tokens,
            "num_computed_tokens": result.num_prompt_tokens - result.num_cached_tokens,
            "cached_tokens_from": result.cached_tokens_from, "replica": result.replica, "decision": result.decision,
            "num_output_tokens": result.num_output_tokens,
            "answer_source": turn.answer_source, "num_answer_ids": len(turn.answer), "answer_ids": turn.answer,
            "started_s": result.started_s, "ttft_s": result.ttft_s, "e2e_s": result.e2e_s}


def warm_up(base_url: str, model: str, seed: int) -> None:
    """One request sharing no prefix with the workload (no BOS, ids from another seed): one-off allocations."""
    rng = random.Random(seed + 7919)
    prompt = [rng.randrange(300, 200_000) for _ in range(256)]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()


def worker_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from ``/proc/<pid>/stat`` (Linux; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def run_once(name: str, flags: list[str], args: argparse.Namespace, workload: MultiTurnWorkload,
             block_size: int) -> dict:
    """One mode once: start a worker, warm it up, run every session, stop it.

    Raises:
        RuntimeError: the worker did not start, or a turn failed.
    """
    started = time.perf_counter()
    with WorkerProcess(*flags, model=args.model, ready_timeout_s=600) as worker:
        ready_s = time.perf_counter() - started
        tokenizer = load_tokenizer(model_cache_dir() / args.model)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        warm_up(worker.base_url, args.model, args.seed)
        subscriber = KVEventsSubscriber(worker.base_url)
        subscriber.wait_snapshot()
        before, cpu_before, load_before = worker_metrics(worker.base_url), worker_cpu_s(worker.proc.pid), load_average()
        received_before = subscriber.counts()
        turns, wall_s = asyncio.run(run_sessions(worker.base_url, args.model, workload, concurrency=args.concurrency,
                                                 session_rate=math.inf, seed=args.seed, encode=encode,
                                                 timeout_s=args.timeout_s))
        time.sleep(0.2)  # > the stream's 0.05 s poll: the last step's events reach the subscriber
        after, cpu_after, load_after = worker_metrics(worker.base_url), worker_cpu_s(worker.proc.pid), load_average()
        received = [b - a for a, b in zip(received_before, subscriber.counts(), strict=True)]
    failed = [t for t in turns if not t.result.ok]
    if failed or len(turns) != sum(len(session.turns) for session in workload.sessions):
        raise RuntimeError(f"{name}: {len(failed)} turns failed, first: {failed[0].result.error if failed else '-'}")
    events = [(t.result.started_s, t.result.started_s + t.result.ttft_s, t.result.started_s + t.result.e2e_s,
               t.prompt, t.answer) for t in turns]
    kv_events = {"batches_received": received[0], "events_received": received[1], "bytes_received": received[2],
                 "events_per_s": received[1] / wall_s, "bytes_per_s": received[2] / wall_s,
                 "snapshot_events": received_before[1], "snapshot_bytes": received_before[2],
                 "subscriber_error": subscriber.error}
    # The worker publishes its ferry_kv_events_sent* counters from the engine loop (throttled, on engine
    # steps), so its delta over the run can include the snapshot sent just before ``before``: snapshot_* say
    # how much that is.
    print(f"{name}: {len(turns)} requests in {wall_s:.1f} s, worker CPU {cpu_after - cpu_before:.1f} s "
          f"(ready in {ready_s:.1f} s, load average {load_before:.1f} -> {load_after:.1f}); KV events received "
          f"{received[1]} in {received[0]} batches, {received[2]} B ({kv_events['events_per_s']:.1f}/s, "
          f"{kv_events['bytes_per_s']:.0f} B/s)", flush=True)
    return {"mode": name, "worker_flags": flags, "worker_ready_s": ready_s, "wall_s": wall_s,
            "worker_cpu_s": cpu_after - cpu_before, "load_average_1m": [load_before, load_after],
            "kv_events_received": kv_events,
            "ideal_computed_tokens_of_run": ideal_prefill_tokens_of_run(events, block_size),
            "worker_metrics_delta": {k: after[k] - before.get(k, 0.0) for k in sorted(after)},
            "requests": [record(t) for t in turns]}


def summarize(name: str, runs: list[dict]) -> dict:
    """A mode's figures over its runs: token counts, wall and CPU seconds are means per run; latency
    percentiles (milliseconds) pool every run's requests."""
    records = [r for run in runs for r in run["requests"]]
    n = len(runs)
    ttft = [r["ttft_s"] for r in records]
    e2e = [r["e2e_s"] for r in records]
    mismatches = sum(1 for r in records
                     if r["answer_source"] == "retokenized" and r["num_answer_ids"] != r["num_output_tokens"])
    metric_names = sorted({k for run in runs for k in run["worker_metrics_delta"]})
    return {
        "mode": name, "num_runs": n, "num_requests": len(records) // n,
        "num_prompt_tokens": sum(r["num_prompt_tokens"] for r in records) / n,
        "num_cached_tokens": sum(r["num_cached_tokens"] for r in records) / n,
        "num_computed_tokens": sum(r["num_computed_tokens"] for r in records) / n,
        "cached_tokens_from": dict(Counter(r["cached_tokens_from"] for r in records)),
        "ideal_computed_tokens_of_run": statistics.fmean(run["ideal_computed_tokens_of_run"] for run in runs),
        "ttft_ms_p50": percentile(ttft, 50) * 1e3, "ttft_ms_p90": percentile(ttft, 90) * 1e3,
        "e2e_ms_p50": percentile(e2e, 50) * 1e3, "e2e_ms_p90": percentile(e2e, 90) * 1e3,
        "wall_s": statistics.fmean(run["wall_s"] for run in runs),
        "worker_cpu_s": statistics.fmean(run["worker_cpu_s"] for run in runs),
        "answers": {"sources": dict(Counter(r["answer_source"] for r in records)), "length_mismatches": mismatches},
        "load_average_1m": [run["load_average_1m"] for run in runs],
        "kv_events_received": {k: statistics.fmean(run["kv_events_received"][k] for run in runs)
                               for k in ("events_received", "bytes_received", "events_per_s", "bytes_per_s")},
        "worker_metrics_delta": {k: sum(run["worker_metrics_delta"].get(k, 0.0) for run in runs) / n
                                 for k in metric_names},
    }


def print_table(modes: list[dict], ratios: dict, ideal: dict) -> None:
    cols = [("mode", "mode", 8, ""), ("reqs", "num_requests", 5, "d"), ("prompt tok", "num_prompt_tokens", 11, ".0f"),
            ("cached tok", "num_cached_tokens", 11, ".0f"), ("computed", "num_computed_tokens", 9, ".0f"),
            ("TTFT p50", "ttft_ms_p50", 9, ".0f"), ("TTFT p90", "ttft_ms_p90", 9, ".0f"),
            ("e2e p50", "e2e_ms_p50", 8, ".0f"), ("e2e p90", "e2e_ms_p90", 8, ".0f"), ("wall s", "wall_s", 7, ".1f"),
            ("CPU s", "worker_cpu_s", 7, ".1f")]
    print("  ".join(f"{title:>{width}}" for title, _, width, _ in cols))
    for row in [*modes, {"mode": "off/on", **ratios}]:
        cells = []
        for _, key, width, spec in cols:
            value = row.get(key)
            ratio = row["mode"] == "off/on" and key != "mode"
            cells.append("-" if value is None else format(value, f">{width}.2f" if ratio else f">{width}{spec}"))
        print("  ".join(f"{c:>{w}}" for c, (_, _, w, _) in zip(cells, cols, strict=True)))
    print(f"latencies in ms; tokens, wall and worker CPU seconds per run. Ideal (unlimited prefix cache, block size {ideal['block_size']}, "
          f"{ideal['concurrency']} in flight): {ideal['num_prompt_tokens']} prompt tokens -> "
          f"{ideal['computed_tokens']} computed = {ideal['ratio']:.2f}x fewer "
          f"(block size 1: {ideal['ratio_block_size_1']:.2f}x); with this run's prompts and timing: "
          f"{modes[-1]['ideal_computed_tokens_of_run']:.0f} computed "
          f"({modes[-1]['num_prompt_tokens'] / modes[-1]['ideal_computed_tokens_of_run']:.2f}x); with the first "
          f"wave admitted one by one: {ideal['computed_tokens_admitted_one_by_one']} computed "
          f"({ideal['num_prompt_tokens'] / ideal['computed_tokens_admitted_one_by_one']:.2f}x).")
    for mode in modes:
        print(f"{mode['mode']}: cached tokens from {mode['cached_tokens_from']}, answers {mode['answers']}, "
              f"load average {mode['load_average_1m']}, KV events received {mode['kv_events_received']}, "
              f"worker metrics delta {mode['worker_metrics_delta']}")


TIER_SECRET = "bench-only-kv-tier-secret-0123456789"  # the workers of one bench run share it (one host)
SPLIT_TURN = 3  # turns 1-3, then a restart or another worker, then turns 4-6


def run_phases(name: str, phases: list[list[str]], args: argparse.Namespace, workload: MultiTurnWorkload) -> dict:
    """A scenario of issue 17: each phase is a fresh worker with its flags; with two phases the first runs
    turns 1-3 and the second turns 4-6 (the sessions' answers carried over), else one worker runs them all."""
    history: dict[str, list[list[int]]] = {}
    tokenizer = load_tokenizer(model_cache_dir() / args.model)
    records, metrics = [], []
    for i, flags in enumerate(phases):
        stop = SPLIT_TURN if len(phases) == 2 and i == 0 else None
        with WorkerProcess(*flags, model=args.model, ready_timeout_s=600, env={"FERRY_KV_TIER_SECRET": TIER_SECRET}
                           ) as worker:
            warm_up(worker.base_url, args.model, args.seed)
            before = worker_metrics(worker.base_url)
            turns, wall_s = asyncio.run(run_sessions(
                worker.base_url, args.model, workload, concurrency=args.concurrency, session_rate=math.inf,
                seed=args.seed, encode=lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                timeout_s=args.timeout_s, history=history, stop_turn=stop))
            time.sleep(2.5)  # > the worker's stats interval: tier counters reach /metrics
            after = worker_metrics(worker.base_url)
        failed = [t for t in turns if not t.result.ok]
        if failed:
            raise RuntimeError(f"{name}: {len(failed)} turns failed, first: {failed[0].result.error}")
        records += [record(t) for t in turns]
        metrics.append({k: after[k] - before.get(k, 0.0) for k in sorted(after) if "tier" in k or "prefix" in k})
        print(f"{name} phase {i + 1}: {len(turns)} requests in {wall_s:.1f} s", flush=True)
    late = [r for r in records if r["turn"] >= SPLIT_TURN]
    return {"scenario": name, "phases": phases, "worker_metrics_delta": metrics,
            "turns_4_6": {"num_requests": len(late), "num_prompt_tokens": sum(r["num_prompt_tokens"] for r in late),
                          "num_cached_tokens": sum(r["num_cached_tokens"] for r in late),
                          "ttft_ms_p50": percentile([r["ttft_s"] for r in late], 50) * 1e3,
                          "ttft_ms_p90": percentile([r["ttft_s"] for r in late], 90) * 1e3},
            "requests": records}


def run_tier_scenarios(args: argparse.Namespace, workload: MultiTurnWorkload, common: list[str]) -> None:
    """Issue 17 acceptance 4: caching off, a warm worker, a restarted worker (disk tier) and a second worker
    (shared tier), compared on turns 4-6; writes ``bench/results/multi_turn_tiers.json``."""
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ferry-kv-tiers-") as tmp:
        disk = ["--kv-offload-disk", f"{tmp}/disk:4GiB"]
        shared = ["--kv-shared", f"file://{tmp}/shared:4GiB"]
        scenarios = [("off", [common + ["--no-prefix-caching"]]), ("warm", [common]),
                     ("restart_disk", [common + disk, common + disk]),
                     ("second_worker_shared", [common + shared, common + shared])]
        results = {name: run_phases(name, phases, args, workload) for name, phases in scenarios}
    warm, off = results["warm"]["turns_4_6"], results["off"]["turns_4_6"]
    summary = {}
    for name in ("warm", "restart_disk", "second_worker_shared"):
        late = results[name]["turns_4_6"]
        summary[name] = {**{k: v for k, v in late.items()},
                         "hit_tokens_vs_warm": late["num_cached_tokens"] / warm["num_cached_tokens"],
                         "ttft_p50_off_over_this": off["ttft_ms_p50"] / late["ttft_ms_p50"]}
    summary["off"] = off
    out = args.out.with_name("multi_turn_tiers.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "host": platform.node(), "cpu_count": os.cpu_count(),
                               "config": vars(workload.config) | {"concurrency": args.concurrency},
                               "bench_wall_s": time.perf_counter() - started, "turns_4_6": summary,
                               "scenarios": results}, indent=2, default=str))
    print(f"{'scenario':>22} {'prompt tok':>10} {'cached':>7} {'vs warm':>8} {'TTFT p50':>9} {'off/this':>8}")
    for name, row in summary.items():
        print(f"{name:>22} {row['num_prompt_tokens']:>10} {row['num_cached_tokens']:>7} "
              f"{row.get('hit_tokens_vs_warm', math.nan):>8.2f} {row['ttft_ms_p50']:>9.0f} "
              f"{row.get('ttft_p50_off_over_this', math.nan):>8.2f}")
    print(f"turns 4-6 only; wrote {out} ({time.perf_counter() - started:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--num-sessions", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--user-tokens", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4, help="sessions in flight (closed loop)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per mode, alternating off/on then on/off (figures: means, pooled percentiles)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="passed to the workers (needs serve --block-size); default: the engine's 16")
    parser.add_argument("--device", default=None, help="worker --device (default: the worker's choice)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per request")
    parser.add_argument("--tiers", action="store_true",
                        help="issue 17 scenarios instead: off, warm, restart with a disk tier, a second worker with "
                             "a shared tier (turns 4-6 compared); writes multi_turn_tiers.json")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multi_turn.json")
    args = parser.parse_args()
    if args.concurrency < 1 or args.repeats < 1:
        parser.error("--concurrency and --repeats must be >= 1")
    try:
        config = MultiTurnConfig(num_sessions=args.num_sessions, num_turns=args.num_turns,
                                 num_system_tokens=args.system_tokens, user_tokens=tuple(args.user_tokens),
                                 max_tokens=args.output_tokens, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    options = serve_options()
    common = ["--device", args.device] if args.device else []
    if args.block_size is not None:
        if "--block-size" not in options:
            parser.error("this worker's serve has no --block-size option yet")
        common += ["--block-size", str(args.block_size)]
    block_size = args.block_size or ENGINE_DEFAULT_BLOCK_SIZE
    switch = "--no-prefix-caching" in options
    workload = MultiTurnWorkload.from_config(config)
    if args.tiers:
        run_tier_scenarios(args, workload, common)
        return
    num_prompt_tokens = workload.num_prompt_tokens()
    computed = workload.ideal_prefill_tokens(block_size, args.concurrency)
    ideal = {"block_size": block_size, "concurrency": args.concurrency, "num_prompt_tokens": num_prompt_tokens,
             "computed_tokens": computed, "ratio": num_prompt_tokens / computed,
             "ratio_block_size_1": num_prompt_tokens / workload.ideal_prefill_tokens(1, args.concurrency),
             "computed_tokens_admitted_one_by_one": workload.ideal_prefill_tokens(block_size, 1)}
    if not switch:
        print("serve --help lists no --no-prefix-caching: both modes run the same worker (ratios ~1.0)", flush=True)
    started = time.perf_counter()
    flags = {"off": common + (["--no-prefix-caching"] if switch else []), "on": common}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.repeats):  # off on, on off, ...: a drift in the machine's load hits both modes alike
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            runs[name].append(run_once(name, flags[name], args, workload, block_size))
    modes = [summarize("off", runs["off"]), summarize("on", runs["on"])]
    off, on = modes
    ratios = {key: off[key] / on[key] if on[key] else None
              for key in ("num_computed_tokens", "ttft_ms_p50", "ttft_ms_p90", "e2e_ms_p50", "e2e_ms_p90", "wall_s",
                          "worker_cpu_s")}
    result = {"model": args.model, "host": platform.node(), "cpu_count": os.cpu_count(),
              "config": vars(config) | {"concurrency": args.concurrency, "repeats": args.repeats},
              "prefix_caching_switch": switch, "bench_wall_s": time.perf_counter() - started, "ideal": ideal,
              "ratios_off_over_on": ratios, "modes": modes, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print_table(modes, ratios, ideal)
    print(f"wrote {args.out} ({result['bench_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
