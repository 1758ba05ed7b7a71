"""Per-track worker arguments: a shell line of ``serve`` options, checked with the worker's own parser.

A track (``PoolTrack.extra_args``, set from ``RolloutPlan.worker_args`` for a canary or preview track)
may carry extra options of ``python -m inference_worker serve``, e.g. ``--max-num-seqs 8`` or, to
rehearse a bad release, ``--fault-error-rate 0.5``. They are appended after the global
``FERRY_WORKER_EXTRA_ARGS`` (argparse keeps the last value, so a track's option overrides the global
one) and run by both backends (the local agent's process, the Kubernetes container args).

:func:`parse_worker_args` parses them with the worker's parser (``inference_worker.cli.serve.add_arguments``)
and its ``validate``, so a typo or an out-of-range value is refused when it is entered, never by a
worker process that fails to start. Options the backend sets itself (model, role, port, labels, drain
timeout) are refused. Abbreviated option names are refused too (the backend-owned check needs full names).

Only an allowlist is operator-settable (:data:`OPERATOR_OPTIONS`, each number within the bounds given there):
listen addresses and ports (``--host``, ``--kv-host``, ``--kv-port``) and secrets (``--kv-link-secret``) never
come from worker arguments (the line is visible to viewers and in ``ps``); the fault-injection options
(:data:`FAULT_OPTIONS`) are refused on clusters marked production (``Cluster.production``; the demo's are not):
:func:`parse_worker_args` with ``faults_allowed=False``.

It lives in fleet (field validation of ``PoolTrack.extra_args`` and ``RolloutPlan.worker_args``) so the
models need no backend code; :func:`apps.operations.backends.track_spec` re-checks the line and turns
:class:`InvalidWorkerArgs` into the backends' ``InvalidWorkerArgs``.
"""

from __future__ import annotations

import argparse
import shlex

from inference_worker.cli import serve

BACKEND_OWNED = ("--model", "--served-model-name", "--role", "--host", "--port", "--model-version", "--pool",
                 "--track", "--replica", "--drain-timeout")
"""Options :meth:`PoolTrackSpec.worker_args` and the backends set from the pool, track and model version."""
MAX_LENGTH = 500
OPERATOR_OPTIONS: dict[str, tuple[float, float] | None] = {
    "--max-num-seqs": (1, 1024),
    "--max-model-len": (1, 1_048_576),
    "--kv-cache-memory": None,  # bytes up to MAX_KV_CACHE_BYTES or a fraction in (0, 1]
    "--block-size": (1, 256),
    "--no-prefix-caching": None,
    "--dtype": None,
    "--kv-bandwidth-gbps": (0.001, 10_000),
    "--kv-timeout": (0.1, 600),
    "--kv-recompute-on-failure": None,
    "--kv-compression": None,
    "--log-level": None,
}
"""Options an operator may set, with inclusive (min, max) bounds for numbers (None: the worker's choices)."""
FAULT_OPTIONS = ("--fault-error-rate", "--fault-seed", "--fault-kv")
"""Fault injection (rehearsing a bad release): only on clusters not marked production."""
MAX_KV_CACHE_BYTES = 1 << 40


class InvalidWorkerArgs(ValueError):
    """A worker-arguments line ``serve`` would refuse; the message names the option."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: ANN201 - argparse's signature (NoReturn)
        raise InvalidWorkerArgs(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="serve", add_help=False, allow_abbrev=False)
    serve.add_arguments(parser)
    return parser


def _serve_options() -> set[str]:
    return {option for action in _parser()._actions for option in action.option_strings}


def parse_worker_args(line: str, *, faults_allowed: bool = True) -> tuple[str, ...]:
    """Split ``line`` like a shell and check it as ``serve`` options; returns the argument tuple.

    Example: ``"--fault-error-rate 0.5 --fault-seed 7"`` -> ``("--fault-error-rate", "0.5", "--fault-seed", "7")``;
    ``""`` -> ``()``.

    Raises:
        InvalidWorkerArgs: unbalanced quotes, longer than ``MAX_LENGTH`` characters, an option the backend sets
            (``BACKEND_OWNED``), an option outside :data:`OPERATOR_OPTIONS` and :data:`FAULT_OPTIONS` (listen
            addresses, secrets), a fault option when ``faults_allowed`` is False, a number outside its bounds,
            an unknown or abbreviated option, a positional argument, a value of the
            wrong type, or a value ``serve`` rejects (e.g. ``--fault-error-rate`` outside [0, 1]); the
            message names the option.
    """
    if not isinstance(line, str):
        raise InvalidWorkerArgs(f"worker arguments must be a string of serve options, got {type(line).__name__}")
    if len(line) > MAX_LENGTH:
        raise InvalidWorkerArgs(f"worker arguments are {len(line)} characters long; at most {MAX_LENGTH}")
    try:
        args = shlex.split(line)
    except ValueError as exc:
        raise InvalidWorkerArgs(f"cannot split worker arguments {line!r} like a shell line: {exc}") from exc
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in BACKEND_OWNED:
            raise InvalidWorkerArgs(f"{name} is set by Ferry from the pool, track and model version; remove it from the "
                              f"worker arguments (set by Ferry: {', '.join(BACKEND_OWNED)})")
        if not name.startswith("--"):
            continue  # a value; the parser refuses a stray positional
        if name in FAULT_OPTIONS and not faults_allowed:
            raise InvalidWorkerArgs(f"{name} injects faults and is refused on a production cluster; rehearse on a "
                                    "cluster marked non-production")
        if name in _serve_options() and name not in OPERATOR_OPTIONS and name not in FAULT_OPTIONS:
            raise InvalidWorkerArgs(f"{name} cannot be set in worker arguments (listen addresses and secrets come from "
                                    f"Ferry); allowed: {', '.join([*OPERATOR_OPTIONS, *FAULT_OPTIONS])}")
    try:
        namespace = _parser().parse_args(["--model", "placeholder", "--port", "1", *args])
        serve.validate(namespace)
        _check_bounds(namespace)
    except InvalidWorkerArgs as exc:
        raise InvalidWorkerArgs(f"invalid worker arguments {line!r}: {exc}") from exc
    except ValueError as exc:
        raise InvalidWorkerArgs(f"invalid worker arguments {line!r}: {exc}") from exc
    return tuple(args)


def _check_bounds(namespace: argparse.Namespace) -> None:
    for option, bounds in OPERATOR_OPTIONS.items():
        value = getattr(namespace, option[2:].replace("-", "_"))
        if bounds is not None and value is not None and not bounds[0] <= value <= bounds[1]:
            raise InvalidWorkerArgs(f"{option} must be within {bounds[0]:g}..{bounds[1]:g}, got {value}")
    if namespace.kv_cache_memory is not None:
        from inference_worker.engine.kv_cache_sizing import parse_kv_cache_memory  # torch-free

        kind, amount = parse_kv_cache_memory(namespace.kv_cache_memory)
        if kind == "bytes" and amount > MAX_KV_CACHE_BYTES:
            raise InvalidWorkerArgs(f"--kv-cache-memory must be at most {MAX_KV_CACHE_BYTES} bytes (1 TiB)")
