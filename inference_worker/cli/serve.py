"""``python -m inference_worker serve``: run one worker with the OpenAI-compatible HTTP API.

Example::

    python -m inference_worker serve --model gemma-3-270m --role colocated --host 127.0.0.1 --port 8001

Roles (prefill/decode disaggregation, see :mod:`inference_worker.server.pd`):

- ``colocated``: prefill and decode here;
- ``prefill``: also serves ``POST /internal/prefill`` (prefill, send the KV to the decode worker's
  receiver, return the first token); ``--kv-bandwidth-gbps`` caps each outgoing KV link (a local
  link can emulate a 10 Gbit/s WAN);
- ``decode``: runs a KV receiver on ``--kv-host``:``--kv-port`` (0: any free port; printed as
  ``KV receiver listening on HOST:PORT`` and reported as ``kv_port`` by ``GET /health``); a request
  carrying ``X-Ferry-Prefill-Endpoint`` (set by the router) is prefilled there, others here. A
  failed hand-off is recomputed here unless ``--kv-recompute-on-failure false`` (then a 502 OpenAI
  error ``kv_transfer_failed``); ``--kv-timeout`` bounds the wait for the KV.

Prefill and decode need the same per-link secret: ``--kv-link-secret`` or the environment variable
``FERRY_KV_LINK_SECRET`` (>= 16 bytes); without one a prefill/decode worker logs a warning and
prefills every prompt itself (no ``/internal/prefill``, no KV receiver). ``--model-version`` labels the metrics and names the model
version in KV payloads (KV from another version is refused). ``--pool``, ``--track`` and
``--replica`` only label the metrics.

``FERRY_WORKER_TOKEN`` (environment only, >= 16 characters; the backend sets it to the pool's worker token)
makes every route but ``/health``, ``/ready`` and ``/metrics`` require ``Authorization: Bearer <token>``;
``FERRY_WORKER_TOKEN_PREVIOUS`` is also accepted during a rotation (:mod:`inference_worker.server.worker_auth`).

KV tiers (:mod:`inference_worker.engine.kv_tiers`): ``--kv-offload-host SIZE``, ``--kv-offload-disk PATH:SIZE``
and ``--kv-shared URI:SIZE`` keep finished contexts' KV beyond the engine's cache (host memory, a local
directory, a directory shared by every worker of these weights); entries idle longer than ``--kv-entry-ttl``
seconds (default 1800) are removed. Entries are signed with the tier secret (``--kv-tier-secret`` or
``FERRY_KV_TIER_SECRET``, >= 16 bytes, required for a disk or shared tier; the same on every worker sharing
a store). Tiers need prefix caching.

``--fault-kv MODE`` (prefill role) damages the KV hand-off on purpose to rehearse a bad KV link
(``corrupt``, ``truncate``, ``wrong-key``, ``wrong-version``, ``delay:S``, ``die-mid-send``); never set
it on a worker that takes production traffic. ``--fault-kv header`` (take the mode per request from the
``X-Ferry-Fault-KV`` header) is a test hook, refused unless ``FERRY_TEST_KV_FAULT_HEADER=1`` is set, which
also makes a decode worker forward that header; see :mod:`inference_worker.server.pd_faults`.

``--fault-error-rate F`` rehearses a bad release: that fraction of valid completion requests
fails with a 500 OpenAI error (``code: injected_fault``), chosen by an RNG seeded with
``--fault-seed`` so a run is reproducible. Operators and the rollout gate tests use it to get a
worker that really fails (a canary that should be rolled back); never set it on a worker that takes
production traffic.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports (torch, fastapi) happen in run(), not when building the CLI parser
    from inference_worker.metrics import WorkerMetrics
    from inference_worker.server.state import ServedModel

ROLES = ("colocated", "prefill", "decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the ``serve`` options on ``parser``."""
    parser.add_argument("--model", required=True, help="built-in name (gemma-3-270m), .gguf path or HF dir")
    parser.add_argument("--role", choices=ROLES, default="colocated",
                        help="colocated, prefill (serves /internal/prefill) or decode (KV receiver)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", help="model id in the API (default: --model)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                        help="the SIGTERM -> exit budget in seconds (the agent's SIGKILL comes after it): in-flight "
                             "requests get all of it but 3 s, then are aborted with finish_reason abort")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length cap in tokens")
    parser.add_argument("--max-body-bytes", type=int, default=None, metavar="B",
                        help="completion request body cap (413 above; default 64 KiB + 32 B per token of context)")
    parser.add_argument("--max-prompts", type=int, default=64, metavar="N",
                        help="most prompts in one /v1/completions batch (400 above)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache budget: bytes with a unit (512MiB, 2GiB) or a fraction of free memory (0.5)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (default 16)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn off prefix caching (reuse of identical prompt prefixes' KV; on by default)")
    parser.add_argument("--kv-offload-host", default=None, metavar="SIZE",
                        help="host-memory KV tier beyond --kv-cache-memory (e.g. 2GiB; off by default)")
    parser.add_argument("--kv-offload-disk", default=None, metavar="PATH:SIZE",
                        help="local-disk KV tier: a directory and its byte budget (e.g. /var/cache/ferry-kv:20GiB)")
    parser.add_argument("--kv-shared", default=None, metavar="URI:SIZE",
                        help="shared KV tier: a directory every worker of these weights mounts (path or file://), "
                             "and its byte budget")
    parser.add_argument("--kv-entry-ttl", type=float, default=1800.0, metavar="S",
                        help="KV tier entries idle (no read or write) longer than this are removed (default 30 min)")
    parser.add_argument("--kv-tier-secret", default=None,
                        help="secret (>= 16 bytes) keying the KV tier records' tags; the same on every worker "
                             "sharing a store (default: env FERRY_KV_TIER_SECRET)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weight/compute dtype (default: the artifact's, else float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--fault-error-rate", type=float, default=0.0, metavar="F",
                        help="TEST ONLY: fail this fraction of valid completion requests with a 500")
    parser.add_argument("--fault-seed", type=int, default=0, help="seed of the --fault-error-rate RNG")
    parser.add_argument("--pool", default="", help="metrics label")
    parser.add_argument("--track", default="", help="metrics label (stable, canary, blue, green)")
    parser.add_argument("--replica", default="", help="metrics label")
    parser.add_argument("--model-version", default="", help="metrics label")
    parser.add_argument("--kv-host", default=None,
                        help="decode: KV receiver address, bound and given to prefill workers (default: --host)")
    parser.add_argument("--kv-port", type=int, default=0, help="decode: KV receiver port (0: any free port)")
    parser.add_argument("--kv-link-secret", default=None,
                        help="per-link secret, >= 16 bytes: keys the KV frames' BLAKE3 tag and the prefill "
                             "requests' HMAC-SHA256 signature (default: env FERRY_KV_LINK_SECRET)")
    parser.add_argument("--kv-bandwidth-gbps", type=float, default=None, metavar="GBPS",
                        help="prefill: cap on each outgoing KV link in Gbit/s (emulates a WAN)")
    parser.add_argument("--kv-timeout", type=float, default=30.0, metavar="S",
                        help="decode: longest wait for one request's KV; prefill: send timeout")
    parser.add_argument("--kv-recompute-on-failure", choices=("true", "false"), default="true",
                        help="decode: prefill locally after a failed KV hand-off (false: 502 error)")
    parser.add_argument("--kv-compression", choices=("none", "zstd"), default="none", help="prefill: KV payload compression")
    parser.add_argument("--fault-kv", default=None, metavar="MODE",
                        help="prefill, fault rehearsal: corrupt|truncate|wrong-key|wrong-version|delay:S|die-mid-send "
                             "(header: test hook, needs FERRY_TEST_KV_FAULT_HEADER=1)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--trace-ratio", type=float, default=None, metavar="F",
                        help="OpenTelemetry sampling ratio 0..1 (default FERRY_TRACE_RATIO, else 0: tracing off); "
                             "spans go to OTEL_EXPORTER_OTLP_ENDPOINT over OTLP/HTTP")


def validate(args: argparse.Namespace) -> None:
    """Check option values argparse cannot.

    Raises:
        ValueError: with the option's name and what is allowed.
    """
    if not 0.0 <= args.fault_error_rate <= 1.0:
        raise ValueError(f"--fault-error-rate must be in [0, 1], got {args.fault_error_rate}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    secret = link_secret(args)
    if secret is not None and len(secret) < 16:
        raise ValueError("the KV link secret (--kv-link-secret or FERRY_KV_LINK_SECRET) must be >= 16 bytes")
    if not 0 <= args.kv_port < 65536:
        raise ValueError(f"--kv-port must be in 0..65535, got {args.kv_port}")
    if args.kv_timeout <= 0:
        raise ValueError(f"--kv-timeout must be > 0 seconds, got {args.kv_timeout}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if args.max_prompts < 1:
        raise ValueError(f"--max-prompts must be at least 1, got {args.max_prompts}")
    if args.kv_bandwidth_gbps is not None and args.kv_bandwidth_gbps <= 0:
        raise ValueError(f"--kv-bandwidth-gbps must be > 0, got {args.kv_bandwidth_gbps}")
    if args.fault_kv is not None:
        from inference_worker.server.pd_faults import TEST_HEADER_ENV, fault_header_enabled, parse_fault

        fault = parse_fault(args.fault_kv)
        if fault is not None and fault[0] == "header" and not fault_header_enabled():
            raise ValueError(f"--fault-kv header is a test hook: it needs {TEST_HEADER_ENV}=1 in the environment")
    if args.kv_cache_memory is not None:
        from inference_worker.engine.kv_cache_sizing import parse_kv_cache_memory  # torch-free

        parse_kv_cache_memory(args.kv_cache_memory)
    tier_stores(args)


def tier_secret(args: argparse.Namespace) -> bytes | None:
    """The KV tier secret from ``--kv-tier-secret`` or ``FERRY_KV_TIER_SECRET`` (None if neither)."""
    value = args.kv_tier_secret or os.environ.get("FERRY_KV_TIER_SECRET")
    return value.encode() if value else None


def tier_stores(args: argparse.Namespace) -> list:
    """The KV tier stores the options ask for, fastest first (host, disk, shared); [] when none.

    Raises:
        ValueError: a bad ``SIZE`` or ``PATH:SIZE`` (a path that cannot be a writable directory included; the
            message names the option), a TTL <= 0, prefix caching off, or a disk/shared tier without a
            tier secret of >= 16 bytes.
    """
    from inference_worker.engine.kv_tier_store import (
        MemoryKVStore,
        open_directory_store,
        parse_store_spec,
        parse_tier_size,
    )

    stores: list = []
    if args.kv_offload_host:
        stores.append(MemoryKVStore(parse_tier_size("--kv-offload-host", args.kv_offload_host)))
    for option, value, tier in (("--kv-offload-disk", args.kv_offload_disk, "disk"),
                                ("--kv-shared", args.kv_shared, "shared")):
        if value:
            path, size = parse_store_spec(option, value)
            stores.append(open_directory_store(option, path, size, tier))
    if not stores:
        return stores
    if args.kv_entry_ttl <= 0:
        raise ValueError(f"--kv-entry-ttl must be > 0 seconds, got {args.kv_entry_ttl}")
    if args.no_prefix_caching:
        raise ValueError("KV tiers need prefix caching: drop --no-prefix-caching or the --kv-offload/--kv-shared options")
    secret = tier_secret(args)
    if (args.kv_offload_disk or args.kv_shared) and (secret is None or len(secret) < 16):
        raise ValueError("a disk or shared KV tier needs a tier secret of >= 16 bytes "
                         "(--kv-tier-secret or FERRY_KV_TIER_SECRET)")
    return stores


def link_secret(args: argparse.Namespace) -> bytes | None:
    """The per-link secret from ``--kv-link-secret`` or ``FERRY_KV_LINK_SECRET`` (None if neither)."""
    value = args.kv_link_secret or os.environ.get("FERRY_KV_LINK_SECRET")
    return value.encode() if value else None


def load_model(args: argparse.Namespace, metrics: WorkerMetrics) -> ServedModel:
    """Build the engine and everything the routes need (runs in the loader thread)."""
    import secrets

    from inference_worker.engine.kv_tiers import KVTierOptions
    from inference_worker.server.engine_adapter import build_served_model

    stores = tier_stores(args)
    kv_tiers = None
    if stores:  # a host-only tier never leaves the process: a random secret is enough
        kv_tiers = KVTierOptions(stores=stores, secret=tier_secret(args) or secrets.token_bytes(32),
                                 model_id=args.served_model_name or args.model, entry_ttl_s=args.kv_entry_ttl)
    return build_served_model(args.model, metrics=metrics, max_num_seqs=args.max_num_seqs,
                              max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                              device=args.device, block_size=args.block_size,
                              enable_prefix_caching=not args.no_prefix_caching, kv_tiers=kv_tiers)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM drains the worker; returns the exit status."""
    import torch

    from inference_worker.metrics import WorkerMetrics
    from inference_worker.server.lifecycle import run_server
    from inference_worker.server.state import ServerState
    from inference_worker.server.worker_auth import WorkerTokens

    validate(args)
    worker_tokens = WorkerTokens.from_env()  # the environment only: never argv, which ps shows to everyone
    if os.environ.get("TORCH_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["TORCH_NUM_THREADS"]))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    identity = {"model": args.served_model_name or args.model, "model_version": args.model_version,
                "role": args.role, "pool": args.pool, "track": args.track, "replica": args.replica}
    state = ServerState(
        served_model_name=args.served_model_name or args.model,
        metrics=WorkerMetrics(identity, gpu=torch.cuda.is_available()),
        fault_error_rate=args.fault_error_rate,
        fault_rng=random.Random(args.fault_seed),
        drain_timeout_s=args.drain_timeout,
        link_secret=link_secret(args),
        worker_tokens=worker_tokens,
        max_body_bytes=args.max_body_bytes,
        max_prompts=args.max_prompts,
    )
    if args.role in ("prefill", "decode") and link_secret(args) is None:
        logging.getLogger(__name__).warning(
            "--role %s without a KV link secret (--kv-link-secret or FERRY_KV_LINK_SECRET): disaggregation is off, "
            "the worker prefills every prompt itself", args.role)
    elif args.role in ("prefill", "decode"):
        from inference_worker.server.pd import PDService, PDSettings
        from inference_worker.server.pd_faults import fault_header_enabled

        state.pd = PDService(PDSettings(
            role=args.role, link_secret=link_secret(args), model_version_id=args.model_version or "unversioned",
            kv_host=args.kv_host or args.host, kv_port=args.kv_port, bandwidth_gbps=args.kv_bandwidth_gbps,
            timeout_s=args.kv_timeout, recompute_on_failure=args.kv_recompute_on_failure == "true",
            compression=args.kv_compression, fault_kv=args.fault_kv, fault_header=fault_header_enabled()),
            state.metrics)
    from inference_worker import tracing

    tracing.configure(f"ferry-worker-{args.role}", tracing.ratio_from_env() if args.trace_ratio is None
                      else tracing.check_ratio(args.trace_ratio))
    try:
        return run_server(state, lambda: load_model(args, state.metrics), host=args.host, port=args.port,
                          log_level=args.log_level)
    finally:
        tracing.shutdown()
