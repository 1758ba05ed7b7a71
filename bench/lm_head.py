"""The vocabulary projection on a CPU: ``linear`` against :func:`~inference_worker.model.transformer.vocab_projection`,
alone and inside the engine's decode step, in the same run.

1. The head alone: Gemma 3 270M's tied ``262144 x 640`` float32 embedding, ``rows`` of 1, 2, 3, 4, 8, 16, 64
   hidden states (a decode step samples one row per sequence), median of ``--repeats`` calls each way.
2. The decode step: the real engine (``LLMEngine``, paged hybrid KV cache) with ``B`` sequences of a 64-token
   prompt decoding, B in 1..4 (the demo's batches), median step seconds with ``CausalLM.compute_logits`` on
   ``linear`` (the reference) and on ``vocab_projection`` (what the engine runs), alternating per round; the
   greedy tokens of both must be equal (else the bench fails).

Ratios are reference / new (above 1: the new path is faster). Writes ``bench/results/lm_head.json``.

    .venv/bin/python bench/lm_head.py [--threads 2] [--repeats 7] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_worker.engine.llm_engine import LLMEngine  # noqa: E402
from inference_worker.engine.sampling_params import SamplingParams  # noqa: E402
from inference_worker.model import transformer  # noqa: E402
from inference_worker.model.loader import load_model  # noqa: E402
from inference_worker.model.prepare import prepare_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def reference_projection(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: ``torch.nn.functional.linear``."""
    return torch.nn.functional.linear(hidden, weight)


def time_call(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def head_alone(weight: torch.Tensor, repeats: int) -> list[dict]:
    rows_out = []
    for rows in (1, 2, 3, 4, 8, 16, 64):
        hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        ref = time_call(lambda h=hidden: reference_projection(h, weight), repeats)
        new = time_call(lambda h=hidden: transformer.vocab_projection(h, weight), repeats)
        diff = (reference_projection(hidden, weight) - transformer.vocab_projection(hidden, weight)).abs().max()
        rows_out.append({"rows": rows, "linear_s": ref, "vocab_projection_s": new, "ratio": ref / new,
                         "max_abs_diff": float(diff)})
        print(f"head, {rows:3d} rows: linear {ref * 1e3:7.1f} ms  vocab_projection {new * 1e3:7.1f} ms  "
              f"x{ref / new:.2f}  max |diff| {float(diff):.2e}", flush=True)
    return rows_out


def decode_steps(engine: LLMEngine, batch: int, steps: int, vocab_size: int, seed: int
                 ) -> tuple[list[float], list[list[int]]]:
    """Step times (s) of the decode steps of ``batch`` sequences (prompts drawn from ``seed``), and their greedy
    tokens. The second system of a round finds the prompts in the prefix cache: only its prefill is shorter."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(10, vocab_size - 10, (64,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", prompt,
                           SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        if all(len(tokens.get(o.request_id, [])) >= 1 for o in outputs) and len(outputs) == batch:
            times.append(dt)  # a pure decode step: every sequence already had its first token
        for o in outputs:
            tokens[o.request_id] = list(o.output.token_ids)
    return times[: steps - 1], [tokens[k] for k in sorted(tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "lm_head.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(str(prepare_model(args.model).path))
    model = loaded.model
    weight = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    print(f"{args.model}: head {tuple(weight.shape)} {weight.dtype}, {args.threads} threads", flush=True)
    result = {"model": args.model, "threads": args.threads, "torch": torch.__version__,
              "head_shape": list(weight.shape), "dtype": str(weight.dtype), "head": head_alone(weight, args.repeats)}

    engine = LLMEngine(loaded, max_num_seqs=8, max_model_len=512, kv_cache_memory="256MiB")
    new_projection = transformer.vocab_projection
    step_rows = []
    for batch in (1, 2, 3, 4):
        samples: dict[str, list[float]] = {"linear": [], "vocab_projection": []}
        for rnd in range(args.rounds):
            outputs = {}
            systems = (("linear", reference_projection), ("vocab_projection", new_projection))
            for name, fn in systems if rnd % 2 == 0 else systems[::-1]:
                transformer.vocab_projection = fn
                try:
                    times, outputs[name] = decode_steps(engine, batch, args.steps, loaded.config.vocab_size,
                                                        seed=1000 * batch + rnd)
                finally:
                    transformer.vocab_projection = new_projection
                samples[name] += times
            if outputs["linear"] != outputs["vocab_projection"]:
                raise SystemExit(f"B={batch}: greedy tokens differ between linear and vocab_projection")
        ref, new = statistics.median(samples["linear"]), statistics.median(samples["vocab_projection"])
        step_rows.append({"batch": batch, "linear_step_s": ref, "vocab_projection_step_s": new, "ratio": ref / new,
                          "steps": len(samples["linear"]), "tokens_equal": True})
        print(f"decode step, B={batch}: linear {ref * 1e3:6.1f} ms  vocab_projection {new * 1e3:6.1f} ms  "
              f"x{ref / new:.2f}  (tokens equal)", flush=True)
    result["decode_step"] = step_rows
    RESULTS.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
