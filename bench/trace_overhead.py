"""Tracing overhead through the router and PD workers (issue 23, acceptance 3): sampling 100% vs off.

Two identical stacks run side by side on this host, each a real router, a prefill worker and a decode worker
(Gemma 3 270M on CPU, remote prefill for prompts over ``--threshold-tokens``): one with ``--trace-ratio 1``
(every request traced, spans exported over OTLP/HTTP to a sink that decodes nothing and answers 200, in a
process of its own: in this one, its thread would take the GIL from the load client's timing at every export), one with tracing off (no SDK provider installed). ``bench/serve_load.py``'s load
(:func:`bench.serve_load.run_level`, its ``word_prompts``: ``--input-words`` words, ``--output-tokens``) runs
against each router in turn, ``--runs`` times each, alternating and flipping the order every round, so host
noise hits both alike. Reported per stack: request throughput and e2e p50 of every run, their medians, the
throughput ratio traced/off (acceptance: within 5%) and the p50 difference (acceptance: at most +2 ms),
with ``uptime`` before and after (the host is shared). JSON to ``bench/results/trace_overhead.json``.

``--micro``: the CPU cost of the tracing code itself, free of serving noise: one child process per mode runs
``--iterations`` times what one remote-prefill request does in the three processes (router, decode and prefill
timelines: 3 request spans with ``traceparent`` extraction and injection, 15 phases, the slow-request rings) and
prints the CPU microseconds per request (``time.process_time``, best of 3 passes). Modes: tracing off; 100% with
the SDK's batch processor and an exporter that drops the spans (the span-making cost alone); 100% with the default
exporter of :func:`inference_worker.tracing.configure` posting to a sink, flushed every 50 requests so the batch
queue drops nothing (the whole cost: since the exporter runs in a child process, that child's CPU is printed too).

Every worker runs with ``--no-prefix-caching``: the runs repeat their prompts, and a cached prompt would make
later runs (and the paired arms sharing the traced stack) cheaper than earlier ones. Warm-up: the whole workload
once per stack, not recorded. ``--paired N``: unloaded latency, N prompts one at a time through three arms (see
:func:`paired_latency`): the p50 bound is about a single request's latency, which queueing at ``--concurrency``
hides under tens of milliseconds of run-to-run spread.

Seen (2026-12-01 21:37, quiet host, load average 0.4-1.7; ``--runs 6 --num-prompts 16 --concurrency 4 --paired
90``): throughput traced 1.616, off 1.644 req/s (medians of 6), ratio **0.983**; e2e p50 at concurrency 4 +24 ms of
~2.4 s (run-to-run spread +-100 ms). Paired, 90 prompts: e2e p50 traced 698.7, unsampled 693.7, off 691.4 ms;
median paired traced - off **+4.48 ms** (95% +1.27..+9.46), traced - unsampled +2.95 (-3.85..+10.76), unsampled -
off +3.44 (-1.93..+9.68). Earlier the same day at load 12-28 the serving runs spread +-30% (see git history).
``--micro --iterations 2000``: off 20.6 us, 100% 755.8 us CPU per remote-prefill request over the three
processes (+735 us, about a quarter of it in each process's request path; the export runs on the SDK's thread).
That figure dropped the spans: with the OTLP export (2026-12-02 01:03-01:06, load average 9-10, this script run
on the tree before and after, alternating, twice), the serving processes spent 978.5 and 1193.9 us per request
with the in-process ``OTLPSpanExporter``; 244.8 and 295.0 us with the export and the phases' spans in the
exporter's child process (:class:`inference_worker.tracing.ProcessSpanExporter`), which spent 900 and 1080 us.

Example::

    python bench/trace_overhead.py --runs 3 --num-prompts 16 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_load import parse_range, run_level, summarize  # noqa: E402
from bench.workloads import word_prompts  # noqa: E402

MODEL = "gemma-3-270m"
SECRET = "ferry-bench-link-secret-0123456789"


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that reads and drops every export (counts the bytes in ``received``, a shared
    ``multiprocessing.Value``)."""

    received = None

    def do_POST(self):  # noqa: N802 - http.server's naming
        size = len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with _Sink.received.get_lock():
            _Sink.received.value += size
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve_sink(port, received) -> None:
    """Child process: serve :class:`_Sink` on a free loopback port, published through ``port``."""
    _Sink.received = received
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    port.value = server.server_port
    server.serve_forever()


def start_sink() -> tuple[str, object, object]:
    """``(url, process, received_bytes)`` of a span sink running in a child process."""
    import multiprocessing
    import time

    port, received = multiprocessing.Value("i", 0), multiprocessing.Value("q", 0)
    process = multiprocessing.Process(target=_serve_sink, args=(port, received), daemon=True)
    process.start()
    deadline = time.monotonic() + 30
    while not port.value:
        if time.monotonic() > deadline or not process.is_alive():
            raise RuntimeError("the span sink process did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{port.value}", process, received


def start_stack(name: str, ratio: float, sink_url: str, tmp: Path, threshold_tokens: int):
    """``(router, workers)`` of one stack; ``ratio`` is every process's ``--trace-ratio``."""
    from inference_worker.tests.support.router import RouterProcess
    from inference_worker.tests.support.worker import WorkerProcess, gemma_tokenizer_dir, start_together

    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink_url + "/v1/traces"}
    common = ("--kv-link-secret", SECRET, "--kv-cache-memory", "256MiB", "--max-num-seqs", "8", "--model-version",
              "v1", "--trace-ratio", str(ratio), "--log-level", "warning",
              # every request computes its whole prompt: with prefix caching on, a prompt repeated across runs
              # (and the paired arms that share the traced stack) would be served from cache
              "--no-prefix-caching")
    prefill = WorkerProcess("--role", "prefill", *common, env=env)
    decode = WorkerProcess("--role", "decode", "--kv-timeout", "120", *common, env=env)
    start_together(prefill, decode)
    table = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
             "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1",
                        "replicas": [{"name": f"{name}-d0", "url": decode.base_url, "track": "stable"}]},
                       {"name": "prefill", "role": "prefill", "datacenter": "dc1",
                        "replicas": [{"name": f"{name}-p0", "url": prefill.base_url, "track": "stable"}]}],
             "length_routing": {"threshold_tokens": threshold_tokens}}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(table))
    import os

    saved = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    os.environ.update(env)
    try:
        router = RouterProcess(path, "--tokenizer", str(gemma_tokenizer_dir()), "--trace-ratio", str(ratio),
                               log_path=tmp / f"router-{name}.log")
    finally:
        os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") if saved is None else os.environ.update(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=saved)
    return router, (prefill, decode)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


async def one_run(url: str, args: argparse.Namespace) -> dict:
    workload = word_prompts(args.num_prompts, args.seed, parse_range(args.input_words), parse_range(args.output_tokens))
    results, duration = await run_level(url, MODEL, workload, concurrency=args.concurrency, request_rate=args.rate,
                                        seed=args.seed, chat=False, timeout_s=600.0)
    row = summarize(results, duration, slo_ttft_s=10.0, slo_tpot_s=1.0)
    return {k: row[k] for k in ("num_completed", "num_failed", "request_throughput_rps", "output_throughput_tok_s",
                                "e2e_ms_p50", "e2e_ms_p99", "ttft_ms_p50")}


async def paired_latency(urls: dict[str, str], args: argparse.Namespace) -> dict:
    """Unloaded latency, paired: ``--paired`` prompts, each sent once to three arms, one request at a time.

    Arms: ``traced`` (the traced stack, sampled: every process records and exports), ``unsampled`` (the same
    traced stack and processes, the client's ``traceparent`` with flags ``00``: the SDK is installed but
    nothing is recorded) and ``off`` (the other stack, no SDK). ``traced - unsampled`` is the cost of recording
    and exporting on identical processes; ``unsampled - off`` is the idle SDK plus whatever differs between two
    stacks. The arms' order rotates every prompt, so drift lands on all alike; reported: each arm's e2e p50 and
    the median of the per-prompt differences (milliseconds) with a 95% bootstrap interval (2,000 resamples).

    Raises:
        RuntimeError: a request failed.
    """
    import random

    import httpx

    from bench.serve_load import auth_headers, one_request

    workload = word_prompts(args.paired, args.seed + 1, parse_range(args.paired_input_words or args.input_words),
                            parse_range(args.paired_output_tokens))
    arms = {"traced": (urls["traced"], {}), "off": (urls["off"], {}),
            "unsampled": (urls["traced"], {"traceparent": f"00-{random.Random(0).getrandbits(128):032x}-"
                                                          f"{random.Random(1).getrandbits(64):016x}-00"})}
    names = list(arms)
    e2e_ms: dict[str, list[float]] = {name: [] for name in names}
    async with httpx.AsyncClient(timeout=600.0, headers=auth_headers()) as client:
        for i, request in enumerate(workload):
            for name in names[i % 3:] + names[:i % 3]:
                url, headers = arms[name]
                result = await one_request(client, url + "/v1/completions", MODEL, request.prompt,
                                           request.max_tokens, False, headers=headers)
                if not result.ok:
                    raise RuntimeError(f"paired request {i} on {name} failed: {result.error}")
                e2e_ms[name].append(result.e2e_s * 1000.0)
    rng = random.Random(args.seed)

    def paired(a: str, b: str) -> dict:
        diffs = [x - y for x, y in zip(e2e_ms[a], e2e_ms[b], strict=True)]
        boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
        return {"median_ms": statistics.median(diffs), "ci95_ms": [boot[50], boot[1949]]}

    return {"num_prompts": len(workload), "e2e_ms_p50": {name: statistics.median(v) for name, v in e2e_ms.items()},
            "traced_minus_off": paired("traced", "off"), "traced_minus_unsampled": paired("traced", "unsampled"),
            "unsampled_minus_off": paired("unsampled", "off"), "e2e_ms": e2e_ms}


def _children_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's live children (Linux ``/proc``)."""
    import os

    total = 0.0
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        for pid in f.read().split():
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def micro_child(mode: str, iterations: int) -> tuple[float, float]:
    """CPU microseconds per request of the tracing path (see the module docstring), ``mode`` ``off``, ``on``
    (exporter that drops the spans) or ``otlp`` (the default exporter of :func:`inference_worker.tracing.configure`,
    posting to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, flushed every 50 requests so none is dropped): ``(this
    process, its child processes)``, from the pass with the least CPU in this process."""
    import time

    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from inference_worker import tracing
    from inference_worker.tracing import RequestSpan, SlowRequests, Timeline

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    tracing.configure("bench", 0.0 if mode == "off" else 1.0, exporter=Drop() if mode == "on" else None)
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None) if mode == "otlp" else None
    rings = [SlowRequests() for _ in range(3)]
    phases = {"router": ("router.admit", "router.route", "router.upstream", "router.relay"),
              "decode": ("worker.parse", "kv.handoff", "kv.transfer", "prefill.compute", "prefill.queue",
                         "decode.queue", "decode"),
              "prefill": ("prefill.queue", "prefill.compute", "prefill.encode", "kv.send")}

    def one_request(i: int) -> None:
        headers: dict[str, str] = {}
        for ring, (role, names) in zip(rings, phases.items(), strict=True):
            timeline = Timeline(role, f"req-{i}")
            span = RequestSpan(f"{role}.request", headers, timeline.start_ns)
            outgoing: dict[str, str] = {}
            span.inject(outgoing)
            now = time.time_ns()
            for name in names:
                timeline.add(name, now, now + 1000, num_output_tokens=8)
            timeline.attributes.update(decode_replica="d0", decision="remote_prefill", cached_tokens=0)
            timeline.finish()
            span.end(timeline)
            ring.record(timeline)
            headers = outgoing

    best = (float("inf"), float("inf"))
    for _ in range(3):
        started, children = time.process_time(), _children_cpu_s()
        for i in range(iterations):
            one_request(i)
            if flush is not None and i % 50 == 49:
                flush()
        if flush is not None:
            flush()
        best = min(best, ((time.process_time() - started) / iterations * 1e6,
                          (_children_cpu_s() - children) / iterations * 1e6))
    tracing.shutdown()
    return best


def micro(iterations: int) -> dict:
    """Run :func:`micro_child` for each mode in child processes (one tracer provider per process), ``otlp``
    against a span sink in a process of its own."""
    import os

    sink_url, sink, received = start_sink()
    env = dict(os.environ, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=sink_url + "/v1/traces")
    out = {}
    try:
        for mode in ("off", "on", "otlp"):
            done = subprocess.run([sys.executable, __file__, "--micro-child", mode, "--iterations", str(iterations)],
                                  capture_output=True, text=True, check=True, env=env)
            own, children = done.stdout.strip().splitlines()[-1].split()
            out[mode] = {"process_us": float(own), "children_us": float(children)}
    finally:
        sink.terminate()
    out["span_bytes_exported"] = received.value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", action="store_true", help="only the tracing path's CPU cost per request")
    parser.add_argument("--micro-child", choices=("on", "off", "otlp"), help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3, help="runs per stack (alternating)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    parser.add_argument("--input-words", default="60:120", help="prompt words MIN:MAX (over the threshold: remote)")
    parser.add_argument("--output-tokens", default="8:16")
    parser.add_argument("--threshold-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paired", type=int, default=0,
                        help="also measure unloaded latency: this many prompts, one request at a time, alternating")
    parser.add_argument("--paired-output-tokens", default="4:8")
    parser.add_argument("--paired-input-words", default="",
                        help="prompt words MIN:MAX of the paired prompts (default: --input-words); short requests "
                             "measure a per-request cost with less noise")
    parser.add_argument("--out", default="bench/results/trace_overhead.json")
    args = parser.parse_args()
    if args.micro_child:
        own, children = micro_child(args.micro_child, args.iterations)
        print(f"{own:.2f} {children:.2f}")
        return
    if args.micro:
        before = uptime()
        cost = micro(args.iterations)
        off, on, otlp = (cost[mode]["process_us"] for mode in ("off", "on", "otlp"))
        print(f"uptime: {before}\ntracing path, CPU per remote-prefill request (router + decode + prefill), in the "
              f"serving process: off {off:.1f} us, 100% (spans dropped) {on:.1f} us, 100% (default OTLP export) "
              f"{otlp:.1f} us, added {otlp - off:.1f} us; in its child processes (the exporter, when one runs): "
              f"{cost['otlp']['children_us']:.1f} us; {cost['span_bytes_exported']} bytes of spans exported")
        return

    sink_url, sink, received = start_sink()
    load_before = uptime()
    runs: dict[str, list[dict]] = {"traced": [], "off": []}
    paired: dict | None = None
    with tempfile.TemporaryDirectory() as tmp:
        stacks = {"traced": start_stack("traced", 1.0, sink_url, Path(tmp), args.threshold_tokens),
                  "off": start_stack("off", 0.0, sink_url, Path(tmp), args.threshold_tokens)}
        try:
            for router, _ in stacks.values():  # warm-up, not recorded: the whole workload once (each new prompt
                asyncio.run(one_run(router.url, args))  # length costs the workers a first, slower pass)
            for i in range(args.runs):
                order = ("traced", "off") if i % 2 == 0 else ("off", "traced")
                for name in order:
                    row = asyncio.run(one_run(stacks[name][0].url, args))
                    runs[name].append(row)
                    print(f"run {i + 1} {name:>6}: {row['request_throughput_rps']:.3f} req/s, "
                          f"e2e p50 {row['e2e_ms_p50']:.1f} ms, failed {row['num_failed']}", flush=True)
            if args.paired:
                paired = asyncio.run(paired_latency({name: stack[0].url for name, stack in stacks.items()}, args))
                p50 = paired["e2e_ms_p50"]
                print(f"paired ({paired['num_prompts']} prompts, one at a time): e2e p50 traced {p50['traced']:.1f} "
                      f"ms, unsampled {p50['unsampled']:.1f} ms, off {p50['off']:.1f} ms", flush=True)
                for key in ("traced_minus_off", "traced_minus_unsampled", "unsampled_minus_off"):
                    d = paired[key]
                    print(f"  median paired {key}: {d['median_ms']:+.2f} ms (95% {d['ci95_ms'][0]:+.2f}.."
                          f"{d['ci95_ms'][1]:+.2f})", flush=True)
        finally:
            for router, workers in stacks.values():
                router.stop()
                for worker in workers:
                    worker.stop()
    load_after = uptime()
    median = {name: {"request_throughput_rps": statistics.median(r["request_throughput_rps"] for r in rows),
                     "e2e_ms_p50": statistics.median(r["e2e_ms_p50"] for r in rows)} for name, rows in runs.items()}
    ratio = median["traced"]["request_throughput_rps"] / median["off"]["request_throughput_rps"]
    p50_delta = median["traced"]["e2e_ms_p50"] - median["off"]["e2e_ms_p50"]
    report = {"args": vars(args), "uptime_before": load_before, "uptime_after": load_after, "runs": runs,
              "median": median, "throughput_ratio_traced_over_off": ratio, "e2e_p50_traced_minus_off_ms": p50_delta,
              "span_bytes_exported": received.value, "paired": paired,
              "acceptance": {"throughput_within_5pct": abs(ratio - 1) <= 0.05, "p50_within_2ms": p50_delta <= 2.0,
                             "paired_p50_within_2ms": None if paired is None else
                             paired["e2e_ms_p50"]["traced"] - paired["e2e_ms_p50"]["off"] <= 2.0}}
    print(f"uptime before: {load_before}\nuptime after:  {load_after}")
    for name in ("traced", "off"):
        print(f"{name:>6}: median {median[name]['request_throughput_rps']:.3f} req/s, "
              f"e2e p50 {median[name]['e2e_ms_p50']:.1f} ms")
    print(f"throughput traced/off {ratio:.3f}; e2e p50 traced - off {p50_delta:+.1f} ms; "
          f"{received.value} bytes of spans exported")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    sink.terminate()


if __name__ == "__main__":
    main()
