"""Builds what the server needs from the engine package: the engine, its thread, tokenizer and chat template.

The only module of the server that imports ``inference_worker.engine``; the routes see a
:class:`~inference_worker.server.state.ServedModel`.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_worker.engine.kv_handoff import kv_layout
from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.metrics import WorkerMetrics
from inference_worker.model.loader import load_model
from inference_worker.model.prepare import weights_sha256
from inference_worker.server.engine_loop import EngineLoop
from inference_worker.server.state import ServedModel
from inference_worker.tokenization import ChatTemplate


def build_served_model(model: str, *, metrics: WorkerMetrics | None = None, max_num_seqs: int | None = None,
                       max_model_len: int | None = None, kv_cache_memory: str | None = None,
                       dtype: str | None = None, device: str | None = None, block_size: int | None = None,
                       enable_prefix_caching: bool = True, kv_tiers: Any = None) -> ServedModel:
    """Load ``model`` into an ``LLMEngine`` and wrap it for the server (the engine thread is not started).

    Args:
        model: built-in name, ``.gguf`` path or prepared HF directory (see ``load_model``).
        metrics: where the engine loop publishes queue depth, KV usage and busy ratio.
        max_num_seqs / max_model_len: engine limits (engine defaults when None).
        kv_cache_memory: KV cache budget as ``--kv-cache-memory`` gives it (``"2GiB"``, ``"0.5"``);
            engine default when None.
        dtype / device: compute dtype and torch device (default: cuda when available, else cpu).
        block_size: tokens per KV block (engine default when None).
        enable_prefix_caching: reuse the KV of identical prompt prefixes (``--no-prefix-caching`` turns it off).
        kv_tiers: host/disk/shared KV tiers (``engine.kv_tiers.KVTierOptions``); None: none.

    Raises:
        ValueError: an invalid option, or a model that cannot be loaded.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine_kwargs: dict = {}
    if max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = max_num_seqs
    if max_model_len is not None:
        engine_kwargs["max_model_len"] = max_model_len
    if kv_cache_memory is not None:
        engine_kwargs["kv_cache_memory"] = kv_cache_memory
    if block_size is not None:
        engine_kwargs["block_size"] = block_size
    loaded = load_model(model, dtype=dtype, device=device)
    sha = loaded.sha256 or weights_sha256(loaded.path)
    engine = LLMEngine(loaded, enable_prefix_caching=enable_prefix_caching, weights_sha256=sha, kv_tiers=kv_tiers,
                       **engine_kwargs)
    tokenizer = engine.tokenizer
    chat_template = ChatTemplate.for_tokenizer_dir(loaded.path) if loaded.path.is_dir() else None

    def make_sampling_params(**options: object) -> SamplingParams:
        return SamplingParams(**options).validate()  # type: ignore[arg-type]

    return ServedModel(
        kv_layout=kv_layout(engine),
        weights_sha256=sha,
        engine_loop=EngineLoop(engine, metrics),
        tokenizer=tokenizer,
        chat_template=chat_template,
        max_model_len=engine.max_model_len,
        max_request_tokens=engine.max_request_tokens,
        kv_capacity_error=engine.kv_capacity_error,
        vocab_size=loaded.config.vocab_size,
        make_sampling_params=make_sampling_params,
    )
