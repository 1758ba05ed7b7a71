"""Shared test helpers: prepared real models, loaded once per test process.

Other test modules reuse these instead of loading weights themselves::

    from inference_worker.testing import load_prepared, prepared_model_dir

    @pytest.fixture(scope="session")
    def gemma():
        return load_prepared("gemma-3-270m")   # LoadedModel, fp32 on CPU, cached per process

``prepared_model_dir(name)`` prepares into the normal model cache (``$FERRY_MODEL_CACHE`` or
``~/.cache/ferry/models``; ``make test`` prepares both built-in models first, so this is a no-op there)
and returns the directory, e.g. for a worker subprocess's ``--model``. Both set torch to one thread,
the test-suite rule on the shared 2-core machines.
"""

from __future__ import annotations

import functools
from pathlib import Path

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
