"""Benchmark: model load time (prepared vs cold from GGUF vs transformers) and batch-1 decode tok/s vs transformers.

Same run, same machine, same prompt, same thread count: our CausalLM over the contiguous cache (SDPA kernel)
against transformers' model class loaded from the same GGUF (fp32, attn_implementation="sdpa",
DynamicCache greedy loop). Ratios are ours / transformers. Writes bench/results/model_load_and_decode.json
and prints a table.

    .venv/bin/python bench/model_load_and_decode.py --models gemma-3-270m smollm2-135m-instruct --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_worker.model.loader import load_model  # noqa: E402
from inference_worker.model.prepare import prepare_model  # noqa: E402
from inference_worker.reference.contiguous_runner import ContiguousModelRunner  # noqa: E402
from inference_worker.registry import gguf_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@torch.inference_mode()
def decode_ours(loaded, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode tok/s, tokens) with greedy batch-1 decoding."""
    runner = ContiguousModelRunner(loaded.model, max_num_seqs=1, max_model_len=len(prompt) + new_tokens + 1)
    t0 = time.perf_counter()
    token = int(runner.prefill(0, prompt).argmax())
    t1 = time.perf_counter()
    tokens = [token]
    for i in range(new_tokens - 1):
        token = int(runner.decode([0], [token], [len(prompt) + i]).argmax(dim=-1)[0])
        tokens.append(token)
    t2 = time.perf_counter()
    return t1 - t0, (new_tokens - 1) / (t2 - t1), tokens


@torch.inference_mode()
def decode_transformers(hf_model, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """Same measurement for transformers (DynamicCache, logits for the last position only)."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    cache = DynamicCache(config=hf_model.config)  # updated in place by every forward
    out = hf_model(torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
    token = int(out.logits[0, -1].argmax())
    t1 = time.perf_counter()
    tokens = [token]
    for _ in range(new_tokens - 1):
        out = hf_model(torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    t2 = time.perf_counter()
    return t1 - t0, (new_tokens - 1) / (t2 - t1), tokens


def bench_model(name: str, prompt_len: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    prepared = prepare_model(name)
    t = time.perf_counter()
    loaded = load_model(str(prepared.path))
    load_prepared_s = time.perf_counter() - t
    t = time.perf_counter()
    cold = load_model(str(gguf_path(name)), load_tokenizer=False)
    load_cold_s = time.perf_counter() - t
    del cold
    path = gguf_path(name)
    t = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="sdpa").eval()
    load_hf_s = time.perf_counter() - t
    text = "Ferry ships the KV cache of hybrid-attention models between datacenters. " * 200
    prompt = loaded.tokenizer.encode(text).ids[:prompt_len]
    decode_ours(loaded, prompt[:16], 4)  # warm-up (allocations, first-call overheads)
    decode_transformers(hf_model, prompt[:16], 4)
    ours_prefill_s, ours_tps, ours_tokens = decode_ours(loaded, prompt, new_tokens)
    hf_prefill_s, hf_tps, hf_tokens = decode_transformers(hf_model, prompt, new_tokens)
    return {
        "model": name, "prompt_tokens": len(prompt), "new_tokens": new_tokens,
        "load_prepared_s": load_prepared_s, "load_cold_gguf_s": load_cold_s, "load_transformers_gguf_s": load_hf_s,
        "prefill_s": {"ours": ours_prefill_s, "transformers": hf_prefill_s},
        "decode_tok_per_s": {"ours": ours_tps, "transformers": hf_tps},
        "decode_speed_ratio": ours_tps / hf_tps,
        "greedy_tokens_identical": ours_tokens == hf_tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gemma-3-270m", "smollm2-135m-instruct"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 = the test-suite setting)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench_model(m, args.prompt_len, args.new_tokens) for m in args.models]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "model_load_and_decode.json"
    meta = {"torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
            "python": platform.python_version()}
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    header = (f"{'model':24s} {'load prep s':>11s} {'load cold s':>11s} {'load HF s':>9s} "
              f"{'ours tok/s':>10s} {'HF tok/s':>9s} {'ratio':>6s} {'same tokens':>11s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:24s} {r['load_prepared_s']:11.2f} {r['load_cold_gguf_s']:11.2f} "
              f"{r['load_transformers_gguf_s']:9.2f} {r['decode_tok_per_s']['ours']:10.2f} "
              f"{r['decode_tok_per_s']['transformers']:9.2f} {r['decode_speed_ratio']:6.2f} "
              f"{str(r['greedy_tokens_identical']):>11s}")
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
