"""GPU check (not CI): bf16 CUDA run of both models against the fp32 CPU reference, plus tok/s.

For each model: the fp32 model on CPU is the reference; the same prepared weights run in bf16 on CUDA with
the SDPA kernel. Reported per model: max |logit diff| and top-1 agreement of the last-position logits
over a few prompts (including ones longer than Gemma's window), greedy-token agreement over 32 steps
(fraction of steps before the first divergence), and CUDA decode tok/s at batch 1 and batch 8. Also
checks the SDPA kernel against the reference kernel on CUDA in fp32 (max |diff| <= 1e-4). Designed to
finish in under 5 minutes on one GPU; writes JSON under bench/results/ (and $OUT when set) and prints a table.

    .venv/bin/python bench/gpu_check.py                  # on a machine with CUDA
    .venv/bin/python bench/gpu_check.py --device cpu --quick   # smoke-test of the script itself (bf16 on CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_worker.kernels import prefill_attention_reference, prefill_attention_sdpa  # noqa: E402
from inference_worker.model.loader import load_model  # noqa: E402
from inference_worker.model.prepare import prepare_model  # noqa: E402
from inference_worker.reference.contiguous_runner import ContiguousModelRunner  # noqa: E402

TEXT = ("Hybrid attention interleaves sliding-window layers with a few full-attention layers, so the KV cache "
        "of long prompts stays small enough to ship between datacenters. ") * 100


@torch.inference_mode()
def greedy(loaded, prompts: list[list[int]], new_tokens: int) -> tuple[list[torch.Tensor], list[list[int]], float]:
    """Prefill every prompt, then decode all together; returns (prefill logits, tokens, decode tok/s)."""
    runner = ContiguousModelRunner(loaded.model, max_num_seqs=len(prompts), max_model_len=4096)
    logits0, tokens = [], []
    for slot, p in enumerate(prompts):
        logits = runner.prefill(slot, p)
        logits0.append(logits.float().cpu())
        tokens.append([int(logits.argmax())])
    slots = list(range(len(prompts)))
    _sync(loaded.device)
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        lens = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)]
        out = runner.decode(slots, [t[-1] for t in tokens], lens).argmax(dim=-1).tolist()
        for seq, tok in zip(tokens, out, strict=True):
            seq.append(int(tok))
    _sync(loaded.device)
    tps = len(prompts) * (new_tokens - 1) / (time.perf_counter() - started)
    return logits0, tokens, tps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernel_check(device: str) -> float:
    """Max |SDPA - reference| in fp32 on ``device`` over window/GQA cases."""
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for group in (1, 4):
        for window in (None, 64):
            for n in (63, 64, 65, 192):
                q = torch.randn(2, n, 2 * group, 64, generator=gen).to(device)
                k = torch.randn(2, n, 2, 64, generator=gen).to(device)
                v = torch.randn(2, n, 2, 64, generator=gen).to(device)
                pos = torch.arange(n, device=device).expand(2, n)
                lens = torch.tensor([n, n], device=device)
                ref = prefill_attention_reference(q, k, v, pos, lens, scale=0.125, sliding_window=window)
                fast = prefill_attention_sdpa(q, k, v, pos, lens, scale=0.125, sliding_window=window)
                worst = max(worst, float((fast - ref).abs().max()))
    return worst


def check_model(name: str, device: str, quick: bool) -> dict:
    prepared = prepare_model(name)
    reference = load_model(str(prepared.path), dtype="float32", device="cpu")
    candidate = load_model(str(prepared.path), dtype="bfloat16", device=device)
    ids = reference.tokenizer.encode(TEXT).ids
    lengths = (16, 100) if quick else (16, 100, 511, 513, 1500)
    prompts = [ids[:n] for n in lengths]
    new_tokens = 8 if quick else 32
    ref_logits, ref_tokens, cpu_tps = greedy(reference, prompts, new_tokens)
    cand_logits, cand_tokens, _ = greedy(candidate, prompts, new_tokens)
    diffs = [float((a - b).abs().max()) for a, b in zip(ref_logits, cand_logits, strict=True)]
    top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(ref_logits, cand_logits, strict=True)) / len(prompts)
    agree = []
    for a, b in zip(ref_tokens, cand_tokens, strict=True):
        first = next((i for i in range(new_tokens) if a[i] != b[i]), new_tokens)
        agree.append(first / new_tokens)
    batch1 = greedy(candidate, [ids[:64]], 16 if quick else 128)[2]
    batch8 = greedy(candidate, [ids[:64]] * 8, 16 if quick else 128)[2]
    return {"model": name, "device": device, "prompt_lengths": list(lengths),
            "max_abs_logit_diff": max(diffs), "per_prompt_logit_diff": diffs, "top1_agreement": top1,
            "greedy_prefix_agreement": sum(agree) / len(agree), "cpu_fp32_tok_s_batched": cpu_tps,
            "tok_s_batch1": batch1, "tok_s_batch8": batch8}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer prompts/tokens (script smoke test)")
    parser.add_argument("--models", nargs="+", default=["gemma-3-270m", "smollm2-135m-instruct"])
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run this on a GPU machine, or use --device cpu --quick to smoke-test", file=sys.stderr)
        return 2
    started = time.perf_counter()
    kernel_diff = kernel_check(args.device)
    rows = [check_model(m, args.device, args.quick) for m in args.models]
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "kernel_sdpa_vs_reference_fp32_max_diff": kernel_diff,
              "results": rows, "seconds": time.perf_counter() - started}
    for directory in [Path(__file__).resolve().parent / "results", Path(os.environ["OUT"]) if "OUT" in os.environ else None]:
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "gpu_check.json").write_text(json.dumps(report, indent=2))
    header = (f"{'model':24s} {'max|dlogit|':>11s} {'top1':>5s} {'greedy agree':>12s} "
              f"{'tok/s b1':>9s} {'tok/s b8':>9s} {'CPU fp32 tok/s':>14s}")
    print(f"device: {report['device']}  kernel SDPA vs reference (fp32): {kernel_diff:.2e}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:24s} {r['max_abs_logit_diff']:11.3f} {r['top1_agreement']:5.2f} "
              f"{r['greedy_prefix_agreement']:12.2f} {r['tok_s_batch1']:9.1f} {r['tok_s_batch8']:9.1f} "
              f"{r['cpu_fp32_tok_s_batched']:14.1f}")
    print(f"total {report['seconds']:.0f}s")
    return 0 if kernel_diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
