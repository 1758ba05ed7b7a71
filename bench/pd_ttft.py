"""TTFT benchmark of prefill/decode disaggregation on real worker processes (Gemma 3 270M).

For prompts of 1K, 4K and 8K tokens, the time to first token seen by a client of the decode
worker (non-streamed request with ``max_tokens=1``, so the response time is the TTFT):

- ``colocated``: the decode worker prefills the prompt itself (no ``X-Ferry-Prefill-Endpoint``);
  this is the reference every other row is divided by, measured in the same run;
- ``disaggregated``: the prompt is prefilled on a prefill worker and its KV sent over loopback
  (uncapped), written into the decode worker's paged cache, then the first token is returned;
- ``10 Gbit/s`` and ``1 Gbit/s``: the same, with the prefill worker's KV link capped by its
  token bucket (``--kv-bandwidth-gbps``) to emulate a cross-datacenter link.

Each row also gives the raw KV bytes sent (hybrid layout: N tokens for the 3 full layers, min(N, 511)
for the 15 sliding ones) and the link's theoretical serialisation time ``raw_bytes * 8 / bandwidth``.
On a CPU-only, shared machine prefill compute dominates TTFT; the ratios show what the transfer adds.
Results: a table on stdout and JSON under ``bench/results/pd_ttft.json``.

    .venv/bin/python bench/pd_ttft.py [--repeats 3] [--sizes 1024,4096,8192] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workloads import ferry_text_tokens  # noqa: E402
from inference_worker import http_headers  # noqa: E402
from inference_worker.config import ModelConfig  # noqa: E402
from inference_worker.kv_transfer.layout import KVLayout  # noqa: E402
from inference_worker.registry import gguf_path  # noqa: E402
from inference_worker.tests.support.worker import WorkerProcess, gemma_tokenizer_dir  # noqa: E402
from inference_worker.tokenization import load_tokenizer  # noqa: E402

MODEL = "gemma-3-270m"
SECRET = "bench-kv-link-secret-0123456789"
LINKS = (("disaggregated", None), ("10 Gbit/s", 10.0), ("1 Gbit/s", 1.0))


def prompt_tokens(num_tokens: int) -> list[int]:
    """``num_tokens`` token ids of a varied English text, BOS first (:func:`bench.workloads.ferry_text_tokens`)."""
    tokenizer = load_tokenizer(gemma_tokenizer_dir())
    return ferry_text_tokens(num_tokens, lambda text: tokenizer.encode(text, add_special_tokens=True).ids)


def ttft(url: str, prompt: list[int], prefill_url: str | None) -> float:
    """Seconds until the (single-token) response arrives."""
    headers = {http_headers.PREFILL_ENDPOINT: prefill_url} if prefill_url else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=900)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    return elapsed


def recomputes(url: str) -> float:
    """Decode-side local recomputes so far (a benchmark row is invalid if any happened)."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("ferry_kv_recompute_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    common = ["--kv-link-secret", SECRET, "--kv-cache-memory", "512MiB", "--max-num-seqs", "2",
              "--kv-timeout", "600", "--model-version", "bench"]
    if args.device:
        common += ["--device", args.device]
    layout = KVLayout.from_model_config(ModelConfig.from_gguf(gguf_path(MODEL)),
                                        dtype="bfloat16" if args.device == "cuda" else "float32")
    prompts = {n: prompt_tokens(n) for n in sizes}
    rows = []
    with WorkerProcess("--role", "decode", *common) as decode:
        for n in sizes:  # warm-up: first request of each size pays one-off allocations
            ttft(decode.base_url, prompts[n], None)
        colocated = {n: [ttft(decode.base_url, prompts[n], None) for _ in range(args.repeats)] for n in sizes}
        for n in sizes:
            rows.append({"mode": "colocated", "tokens": n, "ttft_s": statistics.median(colocated[n]),
                         "samples_s": colocated[n], "raw_bytes": 0, "link_gbps": None, "link_theory_s": 0.0})
        for mode, gbps in LINKS:
            cap = ["--kv-bandwidth-gbps", str(gbps)] if gbps else []
            with WorkerProcess("--role", "prefill", *common, *cap) as prefill:
                before = recomputes(decode.base_url)
                ttft(decode.base_url, prompts[sizes[0]], prefill.base_url)  # warm-up of the link and the worker
                for n in sizes:
                    samples = [ttft(decode.base_url, prompts[n], prefill.base_url) for _ in range(args.repeats)]
                    raw = layout.transfer_bytes(n)
                    rows.append({"mode": mode, "tokens": n, "ttft_s": statistics.median(samples), "samples_s": samples,
                                 "raw_bytes": raw, "link_gbps": gbps,
                                 "link_theory_s": raw * 8 / (gbps * 1e9) if gbps else 0.0})
                if recomputes(decode.base_url) != before:
                    raise RuntimeError(f"{mode}: the decode worker recomputed a prefill; the row is not a transfer")
    reference = {r["tokens"]: r["ttft_s"] for r in rows if r["mode"] == "colocated"}
    for row in rows:
        row["vs_colocated"] = row["ttft_s"] / reference[row["tokens"]]
    result = {"model": MODEL, "device": args.device or "cpu", "repeats": args.repeats, "host": platform.node(),
              "kv_dtype": layout.dtype, "rows": rows}
    out = ROOT / "bench" / "results" / "pd_ttft.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{'mode':<14} {'tokens':>6} {'TTFT s':>8} {'x coloc':>8} {'KV MiB':>8} {'link s (theory)':>16}")
    for row in rows:
        print(f"{row['mode']:<14} {row['tokens']:>6} {row['ttft_s']:>8.3f} {row['vs_colocated']:>8.2f} "
              f"{row['raw_bytes'] / 2**20:>8.2f} {row['link_theory_s']:>16.4f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
