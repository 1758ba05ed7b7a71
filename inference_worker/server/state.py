"""The state one worker server shares between its routes: model, engine loop, readiness, drain.

Readiness: not ready while the model loads (``loading``), after SIGTERM (``draining``) and if
the engine loop died. While draining, new completion requests get 503 but the listener stays
open; in-flight requests are counted so the drain knows when they are all done.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from inference_worker.metrics import WorkerMetrics
from inference_worker.request_limits import DEFAULT_MAX_PROMPTS
from inference_worker.server.engine_loop import EngineLoop
from inference_worker.server.errors import invalid
from inference_worker.tokenization import ChatTemplate
from inference_worker.tracing import SlowRequests


@dataclass
class ServedModel:
    """What the routes need from the model this worker serves: its running engine, tokenizer and limits.

    Not to be confused with :class:`inference_worker.model.loader.LoadedModel` (weights, config and
    tokenizer as loaded from disk), from which the engine under ``engine_loop`` was built.

    Attributes:
        engine_loop: the running engine thread.
        tokenizer: the model's tokenizer.
        chat_template: renders chat messages; None when the model has no chat format.
        max_model_len: context length in tokens (prompt + generated).
        vocab_size: token ids must be below this.
        make_sampling_params: builds the engine's SamplingParams from keyword options
            (max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos). The engine's EOS set
            already includes the chat format's end-of-turn token.
    """

    engine_loop: EngineLoop
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    max_model_len: int
    vocab_size: int
    make_sampling_params: Callable[..., Any]
    kv_layout: Any = None
    """The engine's KV transfer layout (:class:`~inference_worker.kv_transfer.layout.KVLayout`)."""
    weights_sha256: str | None = None
    """sha256 of the served weights (KV is only valid for these)."""
    max_request_tokens: int | None = None
    """Most prompt + output tokens the KV cache can hold for one request (the engine's
    ``max_request_tokens``, <= ``max_model_len``); None: not bounded below ``max_model_len``."""
    kv_capacity_error: Callable[[int, int], str | None] | None = None
    """``(num_prompt_tokens, max_tokens) ->`` why the request can never fit in the KV cache, or None
    (the engine's ``kv_capacity_error``); None: no such check."""

    @property
    def context_len(self) -> int:
        """The context a request can really use: ``max_model_len`` capped by the KV cache (``/v1/models``)."""
        if self.max_request_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, self.max_request_tokens)

    def check_kv_capacity(self, num_prompt_tokens: int, max_tokens: int, *, param: str | None) -> None:
        """Refuse, before it reaches the engine, a request that could never fit in the KV cache even alone.

        Raises:
            OpenAIError: 400 ``context_length_exceeded`` with the engine's reason (blocks needed and held).
        """
        error = self.kv_capacity_error(num_prompt_tokens, max_tokens) if self.kv_capacity_error else None
        if error is not None:
            raise invalid(f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) {error}", param=param,
                          code="context_length_exceeded")


@dataclass
class ServerState:
    """Shared, mutable state of one worker server (owned by the event loop thread).

    Attributes:
        served_model_name: the model id clients send and ``/v1/models`` lists.
        metrics: the worker's metrics (own registry).
        fault_error_rate: fraction of valid completion requests failed on purpose with a 500
            (test-only; 0 disables).
        fault_rng: the deterministic RNG deciding which requests fail.
        drain_timeout_s: the SIGTERM -> exit budget, seconds; in-flight requests get all of it but the abort
            grace and exit margin (:func:`inference_worker.server.lifecycle.drain_wait_s`).
    """

    served_model_name: str
    metrics: WorkerMetrics
    fault_error_rate: float = 0.0
    fault_rng: random.Random = field(default_factory=lambda: random.Random(0))
    drain_timeout_s: float = 30.0
    max_body_bytes: int | None = None
    """Completion request body cap, bytes (413 above); None: ``request_limits.default_max_body_bytes`` of the
    model's context."""
    max_prompts: int = DEFAULT_MAX_PROMPTS
    """Most prompts in one ``/v1/completions`` batch (400 above)."""
    pd: Any = None
    link_secret: bytes | None = None
    """The KV link secret, if configured: signs ``POST /admin/kv-cache/reset`` on a worker without a worker token
    (see :mod:`.kv_cache_routes`)."""
    worker_tokens: Any = None
    """The pool's worker token(s) (:class:`~inference_worker.server.worker_auth.WorkerTokens`) from
    ``FERRY_WORKER_TOKEN``; None: the routes are open (see :mod:`.worker_auth`)."""
    """The disaggregation service (:class:`~inference_worker.server.pd.PDService`) or None (colocated)."""
    model: ServedModel | None = None
    load_error: str | None = None
    draining: bool = False
    num_in_flight: int = 0
    generations: set = field(default_factory=set)
    slow: SlowRequests = field(default_factory=SlowRequests)
    """The recent requests' timelines behind ``GET /debug/slow-requests`` (:mod:`inference_worker.tracing`)."""
    """Generations in flight (``streaming.Generation``); a drain that times out aborts them."""
    _idle: asyncio.Event | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def loading(self) -> bool:
        return self.model is None and self.load_error is None

    @property
    def engine_alive(self) -> bool:
        return self.model is not None and self.model.engine_loop.alive

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready only when loaded, engine alive and not draining."""
        if self.load_error is not None:
            return False, f"model failed to load: {self.load_error}"
        if self.model is None:
            return False, "loading"
        if self.draining:
            return False, "draining"
        if not self.model.engine_loop.alive:
            return False, f"engine loop stopped: {self.model.engine_loop.fatal_error}"
        return True, "ready"

    def set_model(self, model: ServedModel) -> None:
        """Publish a loaded model (called from the loader thread)."""
        if self.pd is not None:
            self.pd.bind_model(model.kv_layout, model.weights_sha256, max_num_tokens=model.context_len)
        with self._lock:
            self.model = model
        self.metrics.set_ready(self.readiness()[0])

    def set_load_error(self, message: str) -> None:
        with self._lock:
            self.load_error = message

    def request_started(self) -> None:
        self.num_in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def request_finished(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()

    def start_draining(self) -> None:
        """Readiness false from now on; new completion requests are refused with 503."""
        self.draining = True
        self.metrics.set_ready(False)

    def abort_all(self) -> int:
        """Abort every generation in flight (drain timeout); returns how many there were."""
        for generation in list(self.generations):
            generation.abort()
        return len(self.generations)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if ``timeout_s`` passed first."""
        if self._idle is None:
            self._idle = asyncio.Event()
        if self.num_in_flight == 0:
            return True
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def should_inject_fault(self) -> bool:
        """Whether this request fails on purpose (``--fault-error-rate``)."""
        return self.fault_error_rate > 0 and self.fault_rng.random() < self.fault_error_rate
