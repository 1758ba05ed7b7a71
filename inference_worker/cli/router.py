"""``python -m inference_worker router``: the OpenAI-compatible front door with PD and length-aware routing.

Example::

    python -m inference_worker router --host 0.0.0.0 --port 8080 \\
        --routing-table http://controlplane:8000/api/v1/routing-table/ --api-keys keys.json \\
        --tokenizer ~/.cache/ferry/models/gemma-3-270m

``--routing-table`` is a JSON file (re-read when it changes) or the control plane's URL (pulled every
``--table-interval`` seconds with an ETag; the service token comes from ``--service-token`` or
``$FERRY_SERVICE_TOKEN``). Clients need a key: the control plane's keys come in its routing table
(``client_keys``), and ``--api-keys FILE`` (keys and rate limits) or one key in ``$FERRY_ROUTER_API_KEY`` adds
keys of the router's own (both sets are accepted when both are configured). A router open to every client takes
an explicit ``--no-auth`` (local tests only); a router with a routing-table file and none of the three refuses to
start.
See :mod:`inference_worker.router` for the decisions. The ``--breaker-*`` options set the circuit breaker
(:mod:`inference_worker.router.breaker`; defaults: eject above 5% errors over 30 s with at least 20
requests, or after 5 failures in a row, for 30 s, then probe).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os

import uvicorn

from inference_worker.router.auth import ApiKeys

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the ``router`` options on ``parser``."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--routing-table", required=True, metavar="FILE|URL",
                        help="routing table JSON file, or the control plane's /api/v1/routing-table/ URL")
    parser.add_argument("--api-keys", default=None, metavar="FILE", help="client API keys and rate limits (JSON)")
    parser.add_argument("--no-auth", action="store_true",
                        help="accept every client without a key (local tests only; otherwise --api-keys or "
                             "$FERRY_ROUTER_API_KEY is required)")
    parser.add_argument("--service-token", default=None,
                        help="bearer token for the control plane (default: $FERRY_SERVICE_TOKEN)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer directory for exact prompt token counts (default: estimate bytes/4)")
    parser.add_argument("--table-interval", type=float, default=1.0, metavar="S", help="routing table refresh period")
    parser.add_argument("--scrape-interval", type=float, default=1.0, metavar="S",
                        help="replica queue-depth scrape period (0: off)")
    parser.add_argument("--connect-timeout", type=float, default=2.0, metavar="S")
    parser.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    parser.add_argument("--max-attempts", type=int, default=3, help="replicas tried before the first byte")
    parser.add_argument("--policy", default="cache_aware", choices=("cache_aware", "least_loaded", "round_robin"),
                        help="replica choice (least_loaded and round_robin are benchmark references)")
    parser.add_argument("--no-kv-index", action="store_true",
                        help="do not follow the replicas' KV events (no prefix index, no cache scoring)")
    parser.add_argument("--track", default=None, metavar="NAME",
                        help="serve only this track (stable, canary, ...): a Gateway API HTTPRoute splits traffic "
                             "between per-track routers")
    parser.add_argument("--breaker-window", type=float, default=30.0, metavar="S",
                        help="seconds of attempt outcomes the circuit breaker's error rate covers")
    parser.add_argument("--breaker-error-rate", type=float, default=0.05, metavar="F",
                        help="eject a replica whose error rate over the window is above F")
    parser.add_argument("--breaker-min-requests", type=int, default=20, metavar="N",
                        help="outcomes the window needs before its error rate can eject")
    parser.add_argument("--breaker-consecutive", type=int, default=5, metavar="N",
                        help="eject a replica after N failed attempts in a row")
    parser.add_argument("--breaker-cooldown", type=float, default=30.0, metavar="S",
                        help="seconds an ejected replica gets no request before one probe (doubles per failed probe)")
    parser.add_argument("--breaker-max-cooldown", type=float, default=300.0, metavar="S")
    parser.add_argument("--no-breaker", action="store_true", help="never eject replicas (benchmark reference)")
    parser.add_argument("--max-context-tokens", type=int, default=32768, metavar="T",
                        help="largest model context served, tokens (sizes the default --max-body-bytes)")
    parser.add_argument("--max-body-bytes", type=int, default=None, metavar="B",
                        help="request body cap (413 above; default 64 KiB + 32 B per token of --max-context-tokens)")
    parser.add_argument("--max-in-flight", type=int, default=512, metavar="N",
                        help="requests in flight in all (503 + Retry-After above)")
    parser.add_argument("--max-in-flight-per-key", type=int, default=64, metavar="N",
                        help="requests in flight per API key, or per client address without keys (429 above)")
    parser.add_argument("--max-prompts", type=int, default=64, metavar="N",
                        help="most prompts in one /v1/completions batch (400 above)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--trace-ratio", type=float, default=None, metavar="F",
                        help="OpenTelemetry sampling ratio 0..1 (default FERRY_TRACE_RATIO, else 0: tracing off); "
                             "spans go to OTEL_EXPORTER_OTLP_ENDPOINT over OTLP/HTTP")


def server_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP/1.1 parser for the router: ``("uvloop", "httptools")`` (libuv and llhttp, in C;
    both in requirements.txt), else the pure-Python ``asyncio`` / ``h11`` they replace, with a warning: those cost the
    router more CPU per request (``bench/router_profile.py`` measures it)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if (loop, http) != ("uvloop", "httptools"):
        log.warning("router on %s/%s: install uvloop and httptools (requirements.txt) for its CPU per request", loop,
                    http)
    return loop, http


def client_keys(args: argparse.Namespace, environ) -> ApiKeys | None:  # noqa: ANN001 - a mapping
    """The router's own client keys: ``--api-keys`` FILE, else ``FERRY_ROUTER_API_KEY`` (one key, no rate limit),
    else None with ``--no-auth``, else none of its own (an empty set) when ``--routing-table`` is the control
    plane's URL: the table's ``client_keys`` are then the only keys (until the first table, every client gets 401).

    Raises:
        ValueError: none of these (a router never runs open by accident), or a bad keys file.
    """
    from inference_worker.router.auth import ApiKey, ApiKeys

    if args.api_keys:
        return ApiKeys.from_file(args.api_keys)
    key = environ.get("FERRY_ROUTER_API_KEY", "")
    if key:
        return ApiKeys([ApiKey("FERRY_ROUTER_API_KEY", hashlib.sha256(key.encode()).digest(), None)])
    if args.no_auth:
        return None
    if args.routing_table.startswith(("http://", "https://")):
        return ApiKeys([])
    raise ValueError("the router needs client keys: --api-keys FILE or FERRY_ROUTER_API_KEY, or a control plane "
                     "--routing-table URL (its client_keys); --no-auth accepts every client (local tests only)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status.

    Raises:
        ValueError: a port outside 1..65535, non-positive timeouts or attempts, a bad API keys file, a
            ``--breaker-*`` value out of range.
    """
    from inference_worker.router.app import Router, RouterConfig
    from inference_worker.router.breaker import BreakerConfig

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_attempts < 1 or args.request_timeout <= 0 or args.connect_timeout <= 0 or args.table_interval <= 0:
        raise ValueError("--max-attempts, --request-timeout, --connect-timeout and --table-interval must be positive")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":  # httpx logs every upstream call at INFO: a second line per request, and per scrape
        logging.getLogger("httpx").setLevel(logging.WARNING)
    keys = client_keys(args, os.environ)
    if keys is None:
        log.warning("--no-auth: the router accepts every client (local tests only)")
    config = RouterConfig(
        routing_table=args.routing_table, api_keys=keys,
        service_token=args.service_token or os.environ.get("FERRY_SERVICE_TOKEN"),
        tokenizer_dir=args.tokenizer, table_interval_s=args.table_interval, scrape_interval_s=args.scrape_interval,
        connect_timeout_s=args.connect_timeout, request_timeout_s=args.request_timeout,
        max_attempts=args.max_attempts, policy=args.policy, kv_index=not args.no_kv_index, track=args.track,
        breaker=BreakerConfig(window_s=args.breaker_window, max_error_rate=args.breaker_error_rate,
                              min_requests=args.breaker_min_requests,
                              max_consecutive_failures=args.breaker_consecutive, cooldown_s=args.breaker_cooldown,
                              max_cooldown_s=args.breaker_max_cooldown, enabled=not args.no_breaker),
        max_context_tokens=args.max_context_tokens, max_body_bytes=args.max_body_bytes,
        max_in_flight=args.max_in_flight, max_in_flight_per_key=args.max_in_flight_per_key,
        max_prompts=args.max_prompts,
    )
    from inference_worker import tracing

    tracing.configure("ferry-router", tracing.ratio_from_env() if args.trace_ratio is None
                      else tracing.check_ratio(args.trace_ratio))
    router = Router(config)
    loop, http = server_stack()
    try:
        uvicorn.run(router.app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30,
                    loop=loop, http=http)
    finally:
        tracing.shutdown()
    return 0
