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


class InvalidWorkerArgs(ValueError):
    """A worker-arguments line ``serve`` would refuse; the message names the option."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: ANN201 - argparse's signature (NoReturn)
        raise InvalidWorkerArgs(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="serve", add_help=False, allow_abbrev=False)
    serve.add_arguments(parser)
    return parser


def parse_worker_args(line: str) -> tuple[str, ...]:
    """Split ``line`` like a shell and check it as ``serve`` options; returns the argument tuple.

    Example: ``"--fault-error-rate 0.5 --fault-seed 7"`` -> ``("--fault-error-rate", "0.5", "--fault-seed", "7")``;
    ``""`` -> ``()``.

    Raises:
        InvalidWorkerArgs: unbalanced quotes, longer than ``MAX_LENGTH`` characters, an option the backend sets
            (``BACKEND_OWNED``), an unknown or abbreviated option, a positional argument, a value of the
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
    try:
        namespace = _parser().parse_args(["--model", "placeholder", "--port", "1", *args])
        serve.validate(namespace)
    except InvalidWorkerArgs as exc:
        raise InvalidWorkerArgs(f"invalid worker arguments {line!r}: {exc}") from exc
    except ValueError as exc:
        raise InvalidWorkerArgs(f"invalid worker arguments {line!r}: {exc}") from exc
    return tuple(args)
