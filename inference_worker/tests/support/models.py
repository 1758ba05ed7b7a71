"""Shared test helpers: prepared real models, loaded once per test process.

Other test modules reuse these instead of loading weights themselves::

    from inference_worker.tests.support.models import load_prepared, prepared_model_dir

    @pytest.fixture(scope="session")
    def gemma():
        return load_prepared("gemma-3-270m")   # LoadedModel, fp32 on CPU, cached per process

``prepared_model_dir(name)`` prepares into the normal model cache (``$FERRY_MODEL_CACHE`` or
``~/.cache/ferry/models``; ``make test`` prepares both built-in models first, so this is a no-op there)
and returns the directory, e.g. for a worker subprocess's ``--model``. Both set torch to one thread,
the test-suite rule on the shared 2-core machines.

``cached_reference(name, key, compute)`` keeps an expensive reference result (e.g. transformers' greedy run
on a GGUF) on disk under ``$FERRY_TEST_CACHE`` or ``~/.cache/ferry/test-references`` (never in the repository),
keyed by what determines it: the caller's key (model file sha256 from :func:`file_sha256`, prompts, lengths,
the reference code) plus the installed torch and transformers versions.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inference_worker.model.loader import LoadedModel, load_model
from inference_worker.model.prepare import prepare_model

GEMMA = "gemma-3-270m"
SMOLLM2 = "smollm2-135m-instruct"


@functools.cache
def prepared_model_dir(name: str) -> Path:
    """Directory of the prepared built-in model ``name`` (prepared now if needed)."""
    return prepare_model(name).path


@functools.cache
def load_prepared(name: str, dtype: str = "float32") -> LoadedModel:
    """The prepared model ``name`` loaded on CPU (one instance per process; treat it as read-only)."""
    torch.set_num_threads(1)
    return load_model(str(prepared_model_dir(name)), dtype=dtype)


def reference_cache_dir() -> Path:
    """Root of cached test references: ``$FERRY_TEST_CACHE`` or ``~/.cache/ferry/test-references``."""
    return Path(os.environ.get("FERRY_TEST_CACHE") or Path.home() / ".cache" / "ferry" / "test-references")


@functools.cache
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of the file's bytes (hashed once per process for a given size and mtime).

    Raises:
        OSError: the file cannot be read.
    """
    stat = os.stat(path)
    return _file_sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cached_reference(name: str, key: dict[str, Any], compute: Callable[[], Any]) -> Any:
    """``compute()``'s result, stored once per key on disk and read back on later runs.

    Args:
        name: a file-name prefix (``[A-Za-z0-9_-]``), e.g. ``"parity-gemma-3-270m"``.
        key: JSON-serialisable values the result depends on (model file sha256, prompt token ids, number of
            tokens, source of the reference function, ...); torch's and transformers' installed versions are
            added here, so upgrading either recomputes.
        compute: returns what ``torch.save`` can store and ``torch.load(weights_only=True)`` reads back
            (tensors, lists, tuples, dicts, ints, floats, strings).

    Returns:
        The stored result, or ``compute()``'s result (then stored, written atomically: concurrent runs each
        write a whole file and the last rename wins).

    Raises:
        TypeError: ``key`` is not JSON-serialisable.
    """
    full_key = {**key, "torch": _version("torch"), "transformers": _version("transformers")}
    digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:32]
    path = reference_cache_dir() / f"{name}-{digest}.pt"
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:  # truncated or foreign file
            warnings.warn(f"recomputing the unreadable cached reference {path}: {exc}", stacklevel=2)
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(value, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return value


def assert_same_under_divergence_rule(label: str, got: list[list[int]], reference: list[tuple[list[int], list[float]]],
                                      *, num_tokens: int, gap: float) -> None:
    """Greedy tokens equal the reference's up to the first step where the reference was a near tie.

    ``got[i]`` are the greedy tokens of prompt ``i``; ``reference[i]`` its reference tokens and the top-2
    logit gap at each step. Both must have ``num_tokens`` tokens. A first difference is accepted only where
    the reference's top-2 gap is below ``gap`` (two candidates within rounding of each other; after it the
    sequences legitimately differ), and is printed; anywhere else it fails naming the prompt and step.
    """
    for i, (tokens, (ref_tokens, gaps)) in enumerate(zip(got, reference, strict=True)):
        assert len(tokens) == num_tokens
        for step, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)):
            if a != b:
                assert gaps[step] < gap, f"{label}: prompt {i} differs at step {step} " \
                                         f"(got {a}, reference {b}, top-2 gap {gaps[step]:.4g})"
                print(f"accepted divergence [{label}] prompt {i} step {step}: gap {gaps[step]:.3g}")
                break
