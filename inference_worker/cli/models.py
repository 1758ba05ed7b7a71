"""``models`` subcommand: prepare built-in or GGUF models into the model cache, list them, show one.

    python -m inference_worker models prepare gemma-3-270m smollm2-135m-instruct
    python -m inference_worker models prepare gemma-3-270m --dtype bfloat16     # -> gemma-3-270m@bf16
    python -m inference_worker models list
    python -m inference_worker models info gemma-3-270m --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import sys
import time

NAME = "models"
HELP = "prepare models into the model cache (dequantized safetensors + tokenizer), list and inspect them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sub-actions ``prepare``, ``list`` and ``info``."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser("prepare", help="prepare models (idempotent: fast when already prepared)")
    prep.add_argument("models", nargs="+", metavar="NAME", help="built-in name (optionally NAME@bf16) or .gguf path")
    prep.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="weight dtype of the artifact (default float32, or the NAME@ suffix)")
    prep.add_argument("--cache-dir", default=None, help="model cache root (default $FERRY_MODEL_CACHE or "
                      "~/.cache/ferry/models)")
    prep.add_argument("--force", action="store_true", help="rebuild even when already prepared")
    actions.add_parser("list", help="built-in models and whether they are prepared")
    info = actions.add_parser("info", help="architecture and KV accounting of a model")
    info.add_argument("model", help="built-in name, .gguf path or HF directory")
    info.add_argument("--tokens", type=int, default=8192, help="sequence length for the KV figures")


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; prints one line per model (prepare) or JSON (info)."""
    if args.action == "prepare":
        return _prepare(args)
    if args.action == "list":
        return _list()
    return _info(args)


def _prepare(args: argparse.Namespace) -> int:
    from inference_worker.model.prepare import prepare_model

    status = 0
    for name in args.models:
        started = time.monotonic()
        try:
            prepared = prepare_model(name, dtype=args.dtype, cache_dir=args.cache_dir, force=args.force)
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            status = 1
            continue
        state = "prepared" if prepared.created else "already prepared"
        print(f"{prepared.name}: {state} in {time.monotonic() - started:.1f}s  dtype={prepared.dtype}  "
              f"sha256={prepared.sha256}  path={prepared.path}")
    return status


def _list() -> int:
    from inference_worker.model.prepare import read_manifest
    from inference_worker.registry import BUILTIN_MODELS, model_cache_dir

    root = model_cache_dir()
    for name, model in BUILTIN_MODELS.items():
        variants = [d.name for d in sorted(root.glob(f"{name}*")) if read_manifest(d)] if root.is_dir() else []
        print(f"{name:24s} {model.description}  prepared: {', '.join(variants) or 'no'}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from inference_worker.config import ModelConfig
    from inference_worker.registry import resolve_model

    try:
        config = ModelConfig.from_path(resolve_model(args.model).path)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = config.to_dict()
    n = args.tokens
    out["kv_bytes"] = {"num_tokens": n, "hybrid": config.kv_bytes(n), "all_full": config.kv_bytes(n, hybrid=False)}
    print(json.dumps(out, indent=2))
    return 0
