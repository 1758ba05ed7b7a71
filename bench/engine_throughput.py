"""Paged engine throughput vs transformers, in the same run, on a mixed workload.

Workload (fixed seed, drawn from ``bench/workloads.py``): prompts of 64..1024 random tokens, outputs of
16..256 tokens (EOS ignored so every request produces exactly its length). Systems:

* ``paged``: Ferry's ``LLMEngine`` (continuous batching, chunked prefill, paged hybrid KV cache) kept
  at C requests in flight (closed loop: a new request enters when one finishes), C in 1, 8, 32.
* ``hf-one``: transformers ``generate`` one request at a time.
* ``hf-static``: transformers ``generate`` on static batches of C requests, left padding, every batch
  runs to its longest output (the extra tokens of shorter requests are not counted as output).

Baseline pinned: same weights (transformers dequantizes the same GGUF file Ferry's prepared artifact
comes from), ``attn_implementation="sdpa"``,
``use_cache=True``, greedy, same dtype, same ``torch.set_num_threads``. Metrics: output tokens/s,
TTFT (paged: from entering the engine; hf-static: from the batch start), TPOT ((finish - first token) /
(output tokens - 1)). ``hf-one`` and ``paged`` at C=1 run on the first ``--num-one`` requests only
(rates are comparable: same length distribution). Also: KV bytes per sequence at 1K/4K/8K tokens from
the allocator's block counts vs DESIGN's hybrid formula and the all-full figure.

Compute accounting: each request's useful FLOPs (:func:`request_flops`: linear layers, attention over the
visible context, LM head per sampled token; padding and recomputation are not useful work) give every system
its achieved GFLOP/s, and a dense fp32 GEMM measured in the same process at the same thread count
(:func:`gemm_gflops`) gives the compute ceiling: the output tok/s no engine can exceed on this CPU for this
workload. ``ceiling / hf-one`` is the largest speed-up over one-at-a-time that batching can buy here: on a CPU
the one-at-a-time baseline is already compute-bound for prefill, unlike a GPU where it is memory-bound.

Usage: ``python bench/engine_throughput.py [--quick]``; prints a table, writes
``bench/results/engine_throughput.json``. ``--reanalyze JSON`` recomputes the compute columns of an earlier
run's results (same workload from its seed) with a fresh GEMM measurement, without re-running the engines.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import random_token_prompts  # noqa: E402
from inference_worker.engine.kv_cache_manager import FULL_ATTENTION, HybridKVCacheManager, KVCacheGroupSpec  # noqa: E402
from inference_worker.engine.llm_engine import LLMEngine  # noqa: E402
from inference_worker.engine.sampling_params import SamplingParams  # noqa: E402
from inference_worker.model.loader import load_model  # noqa: E402
from inference_worker.model.prepare import prepare_model  # noqa: E402
from inference_worker.registry import gguf_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """``num_requests`` (prompt token ids, output length) pairs from :func:`bench.workloads.random_token_prompts`
    (prompts start with BOS id 2)."""
    return [(list(r.prompt), r.max_tokens)
            for r in random_token_prompts(num_requests, prompt_range, output_range, vocab_size, seed)]


def request_flops(config, prompt_len: int, output_len: int) -> float:
    """Useful FLOPs of one request: a prefill of ``prompt_len`` tokens and ``output_len`` sampled tokens.

    Counts matrix multiplies at 2 FLOPs per multiply-add (the 2·N-per-token estimate of Kaplan et al. 2020,
    "Scaling Laws for Neural Language Models", section 2.1, with the attention term made exact):

    * linear layers, per processed token: ``2 · L · (h·q + 2·h·kv + q·h + 3·h·i)`` with ``q = heads·head_dim``,
      ``kv = kv_heads·head_dim``, ``i = intermediate_size`` (gated MLP: gate, up, down);
    * attention scores and values, per processed token and layer: ``2 · 2 · heads · head_dim · ctx`` where
      ``ctx`` is the visible context: ``position + 1`` on full layers, ``min(position + 1, W)`` on sliding ones;
    * the LM head once per sampled token: ``2 · h · vocab``.

    Processed tokens are the prompt and every sampled token but the last (positions ``0 .. P + O - 2``).
    Returns FLOPs (float). Raises ``ValueError`` for a non-positive length.
    """
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"lengths must be >= 1, got prompt {prompt_len}, output {output_len}")
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    linear_per_token = 2 * config.num_hidden_layers * (h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size)
    processed = prompt_len + output_len - 1
    window = config.sliding_window or 0
    num_sliding = sum(1 for t in config.layer_types if t == "sliding_attention")
    num_full = config.num_hidden_layers - num_sliding
    contexts_full = processed * (processed + 1) // 2  # sum of position + 1 over positions 0 .. processed - 1
    contexts_sliding = sum(min(p + 1, window) for p in range(processed)) if num_sliding else 0
    attention = 2 * 2 * q * (num_full * contexts_full + num_sliding * contexts_sliding)
    lm_head = 2 * h * config.vocab_size * output_len
    return float(linear_per_token * processed + attention + lm_head)


def gemm_gflops(threads: int, seconds: float = 3.0, shape: tuple[int, int, int] = (512, 640, 2048)) -> float:
    """Dense fp32 GEMM rate (GFLOP/s) of this CPU at ``threads`` torch threads: an (M, K) @ (K, N) product
    repeated for about ``seconds``; the default shape is a 512-token chunk through Gemma 3 270M's MLP up
    projection (hidden 640, intermediate 2048). Best of three rounds."""
    torch.set_num_threads(threads)
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(3):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 3:
            torch.mm(a, b)
            reps += 1
        best = max(best, 2 * m * k * n * reps / elapsed / 1e9)
    return best


def add_compute_columns(results: list[dict], workload: list[tuple[list[int], int]], config, num_one: int,
                        gemm: float) -> dict:
    """Adds ``useful_gflop_s`` and ``x_ceiling`` to every result (in place); returns the ceiling summary.

    A result over ``num_requests`` requests ran the first ``num_requests`` of the workload (C=1 runs the first
    ``num_one``); its useful FLOPs are those requests' :func:`request_flops`.
    """
    flops = [request_flops(config, len(p), n) for p, n in workload]
    outs = [n for _, n in workload]
    for r in results:
        k = r["num_requests"]
        r["useful_gflop_s"] = sum(flops[:k]) / r["wall_s"] / 1e9
        r["ceiling_tok_s"] = gemm * 1e9 / (sum(flops[:k]) / sum(outs[:k]))
        r["x_ceiling"] = r["output_tok_s"] / r["ceiling_tok_s"]
    one = next((r for r in results if r["system"] == "hf-one"), None)
    full = [r for r in results if r["num_requests"] == len(workload)]
    ceiling = full[0]["ceiling_tok_s"] if full else None
    return {
        "gemm_gflop_s": gemm,
        "flop_per_output_token": sum(flops) / sum(outs),
        "ceiling_tok_s": ceiling,
        # the most any batching engine could gain over one-at-a-time on this CPU, compared as compute rates
        "max_x_hf_one": (gemm / one["useful_gflop_s"]) if one else None,
    }


def summarize(name: str, concurrency: int, wall_s: float, ttfts: list[float], tpots: list[float],
              num_output_tokens: int) -> dict:
    return {
        "system": name,
        "concurrency": concurrency,
        "num_requests": len(ttfts),
        "output_tokens": num_output_tokens,
        "wall_s": round(wall_s, 3),
        "output_tok_s": num_output_tokens / wall_s,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "tpot_mean_s": statistics.fmean(tpots) if tpots else None,
    }


def run_paged(engine: LLMEngine, workload: list[tuple[list[int], int]], concurrency: int) -> dict:
    """Closed loop: keep ``concurrency`` requests in the engine until the workload is done."""
    pending = list(enumerate(workload))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    ttfts, tpots, num_out = [], [], 0
    start = time.perf_counter()
    preemptions_before = engine.core.num_preemptions
    while pending or engine.has_unfinished_requests():
        while pending and len(added) - len(ttfts) < concurrency:
            i, (prompt, out_len) = pending.pop(0)
            rid = f"c{concurrency}-{i}"
            added[rid] = time.perf_counter()
            engine.add_request(rid, prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                n = len(out.output.token_ids)
                num_out += n
                ttfts.append(first[out.request_id] - added[out.request_id])
                if n > 1:
                    tpots.append((now - first[out.request_id]) / (n - 1))
    result = summarize("paged", concurrency, time.perf_counter() - start, ttfts, tpots, num_out)
    result["preemptions"] = engine.core.num_preemptions - preemptions_before
    return result


class _FirstTokenTimer:
    """transformers streamer: ``put`` is called with the prompt, then with each new token batch."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float]:
    """Left-padded static batch; returns (seconds to first token, seconds total)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    timer = _FirstTokenTimer()
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, use_cache=True, streamer=timer,
                         pad_token_id=0)
    total = time.perf_counter() - start
    if out.shape[1] != width + max_new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {max_new_tokens}")
    return timer.first_token_time - start, total


def run_hf(model, workload: list[tuple[list[int], int]], batch_size: int, name: str) -> dict:
    ttfts, tpots, num_out = [], [], 0
    start = time.perf_counter()
    for b in range(0, len(workload), batch_size):
        batch = workload[b : b + batch_size]
        max_new = max(n for _, n in batch)
        ttft, total = hf_generate(model, [p for p, _ in batch], max_new)
        for _, n in batch:
            num_out += n
            ttfts.append(ttft)
            # a request's own tokens arrive at the batch's pace: one per decode step
            tpots.append((total - ttft) / (max_new - 1))
    return summarize(name, batch_size, time.perf_counter() - start, ttfts, tpots, num_out)


def kv_bytes_per_sequence(engine: LLMEngine, lengths: list[int]) -> list[dict]:
    """Allocator-counted KV bytes of one sequence while computing token N, vs DESIGN's formulas."""
    core = engine.core
    config = engine.loaded.config
    dtype_bytes = core.kv_plan.dtype_bytes
    rows = []
    for n in lengths:
        specs = [KVCacheGroupSpec(g.attention_type, g.layer_indices, g.sliding_window, n // 16 + 2, 16)
                 for g in core.kv_plan.groups]
        kv = HybridKVCacheManager(specs)
        computed = 0
        while computed < n - 1:
            step = min(2048, n - 1 - computed)
            kv.allocate_slots("r", computed, step)
            computed += step
        kv.allocate_slots("r", computed, 1)
        per_token_layer = config.kv_bytes_per_token(FULL_ATTENTION, dtype_bytes)
        measured = sum(held * 16 * len(g.layer_indices) * per_token_layer
                       for held, g in zip(kv.num_held_blocks("r"), core.kv_plan.groups, strict=True))
        formula = config.kv_bytes(n, dtype_bytes=dtype_bytes)
        all_full = config.kv_bytes(n, hybrid=False, dtype_bytes=dtype_bytes)
        rows.append({"tokens": n, "measured_bytes": measured, "formula_bytes": formula, "all_full_bytes": all_full,
                     "measured_over_formula": measured / formula, "all_full_over_measured": all_full / measured})
    return rows


def print_tables(model: str, dtype: str, threads: int, num_requests: int, prompt_range, output_range,
                 results: list[dict], kv_rows: list[dict], compute: dict) -> None:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{model} {dtype} threads={threads} requests={num_requests} "
          f"prompts {tuple(prompt_range)} outputs {tuple(output_range)}")
    print(f"{'system':<10} {'C':>3} {'reqs':>4} {'out tok/s':>10} {'TTFT mean s':>12} {'TTFT p50 s':>11} "
          f"{'TPOT ms':>8} {'x hf-one':>9} {'x hf-static':>12} {'GFLOP/s':>8} {'of ceiling':>11}")
    for r in results:
        print(f"{r['system']:<10} {r['concurrency']:>3} {r['num_requests']:>4} {r['output_tok_s']:>10.2f} "
              f"{r['ttft_mean_s']:>12.2f} {r['ttft_p50_s']:>11.2f} "
              f"{fmt(r['tpot_mean_s'] and r['tpot_mean_s'] * 1e3, '8.1f'):>8} "
              f"{fmt(r['x_hf_one'], '9.2f'):>9} {fmt(r['x_hf_static_same_c'], '12.2f'):>12} "
              f"{r['useful_gflop_s']:>8.1f} {r['x_ceiling']:>11.2f}")
    print(f"\ncompute ceiling: fp32 GEMM {compute['gemm_gflop_s']:.1f} GFLOP/s at {threads} thread(s); workload "
          f"{compute['flop_per_output_token'] / 1e9:.2f} GFLOP per output token -> at most "
          f"{fmt(compute['ceiling_tok_s'], '.1f')} output tok/s; the most batching can gain over hf-one here: "
          f"{fmt(compute['max_x_hf_one'], '.2f')}x")
    print(f"\n{'tokens':>6} {'measured KV MiB':>16} {'formula MiB':>12} {'all-full MiB':>13} {'meas/formula':>13} "
          f"{'all-full/meas':>14}")
    for k in kv_rows:
        print(f"{k['tokens']:>6} {k['measured_bytes'] / 2**20:>16.2f} {k['formula_bytes'] / 2**20:>12.2f} "
              f"{k['all_full_bytes'] / 2**20:>13.2f} {k['measured_over_formula']:>13.3f} "
              f"{k['all_full_over_measured']:>14.2f}")


def reanalyze(path: Path, out: Path) -> None:
    """Recompute the compute columns of an earlier run (same workload from its seed and ranges)."""
    from inference_worker.config import ModelConfig

    data = json.loads(path.read_text())
    config = ModelConfig.from_path(prepare_model(data["model"]).path)
    workload = make_workload(data["num_requests"], tuple(data["prompt_range"]), tuple(data["output_range"]),
                             config.vocab_size, data["seed"])
    data["compute"] = add_compute_columns(data["results"], workload, config, data["num_one"],
                                          gemm_gflops(data["threads"]))
    data["reanalyzed_from"] = str(path)
    print_tables(data["model"], data["dtype"], data["threads"], data["num_requests"], data["prompt_range"],
                 data["output_range"], data["results"], data["kv_bytes_per_sequence"], data["compute"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"\nwrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--quick", action="store_true", help="8 requests, prompts 64..256, outputs 16..48, C in 1,4,8")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-one", type=int, default=4, help="requests run one at a time (paged C=1 and hf-one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[64, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_throughput.json")
    parser.add_argument("--reanalyze", type=Path, metavar="JSON",
                        help="recompute the compute columns of an earlier run's JSON (engines are not re-run)")
    args = parser.parse_args()
    if args.reanalyze:
        reanalyze(args.reanalyze, args.out)
        return
    prompt_range, output_range = tuple(args.prompt_range), tuple(args.output_range)
    if args.quick:
        args.num_requests, args.num_one, args.concurrency = 8, 2, [1, 4, 8]
        prompt_range, output_range = (64, 256), (16, 48)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model_dir = prepare_model(args.model).path
    loaded = load_model(str(model_dir))
    dtype = next(loaded.model.parameters()).dtype
    engine = LLMEngine(loaded, max_num_seqs=max(args.concurrency), max_model_len=2048,
                       kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens)
    workload = make_workload(args.num_requests, prompt_range, output_range, loaded.config.vocab_size, args.seed)
    engine.generate([workload[0][0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up

    results = []
    for c in args.concurrency:
        subset = workload[: args.num_one] if c == 1 else workload
        results.append(run_paged(engine, subset, c))
        print(f"paged C={c}: {results[-1]['output_tok_s']:.2f} tok/s", flush=True)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        gguf = gguf_path(args.model)  # the same weights the prepared artifact was made from
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype,
                                                  attn_implementation="sdpa").eval()
        hf_generate(hf, [workload[0][0][:16]], 2)  # warm-up
        results.append(run_hf(hf, workload[: args.num_one], 1, "hf-one"))
        print(f"hf-one: {results[-1]['output_tok_s']:.2f} tok/s", flush=True)
        for c in args.concurrency:
            if c > 1:
                results.append(run_hf(hf, workload, c, "hf-static"))
                print(f"hf-static C={c}: {results[-1]['output_tok_s']:.2f} tok/s", flush=True)

    one = next((r for r in results if r["system"] == "hf-one"), None)
    for r in results:
        static = next((s for s in results if s["system"] == "hf-static" and s["concurrency"] == r["concurrency"]), None)
        r["x_hf_one"] = r["output_tok_s"] / one["output_tok_s"] if one else None
        r["x_hf_static_same_c"] = r["output_tok_s"] / static["output_tok_s"] if static and r["system"] == "paged" else None
    kv_rows = kv_bytes_per_sequence(engine, [1024, 4096, 8192])
    compute = add_compute_columns(results, workload, loaded.config, args.num_one, gemm_gflops(args.threads))

    print_tables(args.model, str(dtype), args.threads, args.num_requests, prompt_range, output_range, results,
                 kv_rows, compute)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": args.model, "dtype": str(dtype), "threads": args.threads, "quick": args.quick,
        "num_requests": args.num_requests, "num_one": args.num_one, "prompt_range": prompt_range,
        "output_range": output_range, "seed": args.seed, "kv_cache": engine.core.kv_cache_report,
        "machine": platform.machine(), "torch": torch.__version__, "results": results, "kv_bytes_per_sequence": kv_rows,
        "compute": compute,
    }, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
