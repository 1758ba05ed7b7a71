"""The engine's own thread, bridged to the asyncio server.

``LLMEngine`` is single-threaded: only :class:`EngineLoop`'s thread touches it. The event loop
hands work over through a command queue (add, abort) and receives per-request
:class:`SeqUpdate` objects on an ``asyncio.Queue`` per request, filled with
``loop.call_soon_threadsafe`` so no request waits on another's HTTP I/O and the HTTP side never
waits on ``step()``.

PD hand-off (:mod:`.pd`; the engine's KV connector copies the KV, see ``engine.kv_handoff``):
:meth:`EngineLoop.prefill_export` (prefill role) and :meth:`EngineLoop.submit_prefilled` (decode role).
Prefix cache: a request's hit goes out as a :class:`SeqUpdate` with ``num_cached_tokens`` when the
engine admits it, before its first token (for the ``X-Ferry-Cached-Tokens`` header); KV events are
drained into a :class:`~.kv_events.KVEventLog` after every step. Busy ratio, queue depth, KV usage
and prefix-cache counters go to the worker metrics (:mod:`.engine_stats`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from inference_worker.metrics import WorkerMetrics
from inference_worker.server.engine_stats import EngineStats, engine_queue_stats
from inference_worker.server.kv_events import KVEventLog

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
__all__ = ["EngineLoop", "SeqUpdate", "engine_queue_stats"]


@dataclass(frozen=True)
class SeqUpdate:
    """New tokens of one engine request since the previous update.

    Attributes:
        request_id: the engine request this update belongs to.
        new_token_ids: token ids generated since the last update (may be empty).
        new_text: text that became safe to send with them (the engine's incremental detokenizer
            holds back partial UTF-8 characters and possible stop-string prefixes).
        num_prompt_tokens: the request's prompt length.
        finished: the request is done; no further updates follow.
        finish_reason: "stop" (EOS, stop token or stop string), "length", "abort" or "error".
        error: a message when ``finish_reason`` is "error".
        error_code: OpenAI error code for ``error`` (None: ``engine_error``).
        num_cached_tokens: set on the update that reports the request's admission: prompt tokens not
            computed for this request (the prefix-cache hit; for a PD import, the prefill worker's hit).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    num_cached_tokens: int | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    stream: _Stream = field(repr=False)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Export:
    """Prefill role: run the prompt's prefill, then hand its KV and first token to ``future``."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    future: asyncio.Future = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread and resolve ``future`` with its result."""

    fn: Any = field(repr=False)
    future: asyncio.Future = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)


@dataclass
class _Import:
    """Decode role: continue a request whose prefill (KV + first token) was done elsewhere."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    first_token_id: int
    kv: Any = field(repr=False)
    first_positions: list[int]
    stream: _Stream = field(repr=False)
    num_cached_tokens: int = 0  # the prefill worker's prefix-cache hit


class EngineLoop:
    """Runs ``engine.step()`` in a daemon thread and routes outputs to waiting coroutines.

    Args:
        engine: an ``LLMEngine`` (``add_request``, ``step``, ``abort_request``,
            ``has_unfinished_requests``).
        metrics: the worker's metrics; queue depth, KV usage and busy ratio are published there.
    """

    def __init__(self, engine: Any, metrics: WorkerMetrics | None = None):
        self._engine = engine
        self._metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._exports: dict[str, _Export] = {}
        self._export_admitted_ns: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._fatal: str | None = None
        self.kv_events = KVEventLog()
        self._stats = EngineStats(engine, metrics, self.kv_events)
        if hasattr(engine, "set_admission_listener"):
            engine.set_admission_listener(self._on_admitted)

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to exit and wait up to ``timeout_s`` seconds."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """True while the thread runs and the engine has not failed."""
        return self._thread.is_alive() and self._fatal is None

    @property
    def fatal_error(self) -> str | None:
        """The error that stopped the engine, if any."""
        return self._fatal

    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any,
               updates: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a request for the engine; must be called from the event loop.

        Args:
            updates: the queue to deliver to (several requests may share one); a new one if None.

        Returns:
            the ``asyncio.Queue`` that receives this request's :class:`SeqUpdate` objects, the
            last with ``finished=True``.

        Raises:
            RuntimeError: the engine loop is not alive.
        """
        self._check_alive()
        stream = _Stream(loop=asyncio.get_running_loop(), queue=updates if updates is not None else asyncio.Queue())
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, stream))
        return stream.queue

    def _check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError(f"engine loop is not running: {self._fatal or 'stopped'}")

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away); its KV blocks are freed on the engine's next turn."""
        self._commands.put(_Abort(request_id))

    def prefill_export(self, request_id: str, prompt_token_ids: list[int], params: Any) -> asyncio.Future:
        """Prefill role: run the prefill of ``prompt_token_ids`` and export its KV.

        ``params`` should have ``max_tokens`` 1: the engine saves the prompt's KV when the request
        finishes with its first token. Returns a future resolving to ``(first_token_id, num_tokens,
        kv, num_cached_tokens)`` (KV as in ``PagedLLMEngine.pop_exported_kv``; ``num_cached_tokens``: prompt
        tokens this prefill reused from the prefix cache), or failing with the engine's ValueError /
        RuntimeError.

        Raises:
            RuntimeError: the engine loop is not alive.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Export(request_id, list(prompt_token_ids), params, future, loop))
        return future

    def submit_prefilled(self, request_id: str, prompt_token_ids: list[int], params: Any, first_token_id: int,
                         kv: Any, first_positions: list[int], updates: asyncio.Queue, num_cached_tokens: int = 0) -> None:
        """Decode role: continue a request prefilled elsewhere (KV imported into the paged cache).

        Updates arrive on ``updates`` as for :meth:`submit`, the first one carrying the first token and
        ``num_cached_tokens`` (the prefill worker's prefix-cache hit, reported as this request's).
        Without room now, the import waits for a seat and blocks like any request (FCFS).

        Raises:
            RuntimeError: the engine loop is not alive.
        """
        self._check_alive()
        stream = _Stream(loop=asyncio.get_running_loop(), queue=updates)
        self._commands.put(_Import(request_id, list(prompt_token_ids), params, int(first_token_id), kv,
                                   list(first_positions), stream, int(num_cached_tokens)))

    def pop_export_admitted_ns(self, request_id: str) -> int | None:
        """When the engine admitted the :meth:`prefill_export` of ``request_id`` (ns since the Unix epoch; its
        queue wait ends there), or None if not reported; forgets it."""
        return self._export_admitted_ns.pop(request_id, None)

    def call(self, fn: Any) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread; returns a future with its result or exception.

        Raises:
            RuntimeError: the engine loop is not alive.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Call(fn, future, loop))
        return future

    async def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (engine thread); returns how many blocks were forgotten."""
        def reset(engine: Any) -> int:
            cleared = engine.reset_prefix_cache()
            self._drain_kv_events()
            return cleared

        return await self.call(reset)

    async def kv_events_snapshot(self) -> tuple[int, list[dict]]:
        """``(seq, events)``: the prefix cache now as ``cleared`` + ``stored`` events, consistent with ``seq``."""
        def snapshot(engine: Any) -> tuple[int, list[dict]]:
            self._drain_kv_events()
            return self.kv_events.seq, [event.as_dict() for event in engine.kv_events_snapshot()]

        return await self.call(snapshot)

    # ---- engine-thread side ----------------------------------------------------------------
    def _drain_kv_events(self) -> None:
        take = getattr(self._engine, "take_kv_events", None)
        if take is not None:
            events = take()
            if events:
                self.kv_events.extend(events)

    def _on_admitted(self, num_cached_tokens: dict[str, int]) -> None:
        """Engine callback (inside ``step``, before the forward): report each admitted request's hit (a
        prefill-role export's admission time goes to :meth:`pop_export_admitted_ns`)."""
        now_ns = time.time_ns()
        for request_id, hit in num_cached_tokens.items():
            if request_id in self._exports:
                self._export_admitted_ns[request_id] = now_ns
            if request_id in self._streams:
                self._send(request_id, SeqUpdate(request_id, (), "", 0, False, num_cached_tokens=hit))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._engine.has_unfinished_requests()
                self._drain_commands(block=not busy)
                if self._engine.has_unfinished_requests():
                    started = time.monotonic()
                    outputs = self._engine.step()
                    self._stats.add_busy(time.monotonic() - started)
                    for output in outputs:
                        self._deliver(output)
                    self._drain_kv_events()
                self._stats.maybe_publish()
        except Exception as exc:  # noqa: BLE001 - thread boundary: report any engine failure to all requests
            logger.exception("engine loop failed")
            self._fatal = f"{type(exc).__name__}: {exc}"
            for request_id in list(self._streams):
                self._send(request_id, SeqUpdate(request_id, (), "", 0, True, "error", f"engine failed: {self._fatal}"))
            for command in self._exports.values():
                command.loop.call_soon_threadsafe(_set_exception, command.future,
                                                  RuntimeError(f"engine failed: {self._fatal}"))
            self._fail_pending_calls()

    def _drain_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call | _Export):
                command.loop.call_soon_threadsafe(_set_exception, command.future,
                                                  RuntimeError(f"engine failed: {self._fatal}"))

    def _apply(self, command: _Add | _Abort | _Export | _Import | _Call) -> None:
        if isinstance(command, _Call):
            try:
                result = command.fn(self._engine)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                command.loop.call_soon_threadsafe(_set_exception, command.future, exc)
            else:
                command.loop.call_soon_threadsafe(_set_result, command.future, result)
            return
        if isinstance(command, _Export | _Import):
            self._apply_handoff(command)
            return
        if isinstance(command, _Abort):
            export = self._exports.pop(command.request_id, None)
            if export is not None:  # a prefill-role request whose decode worker went away
                self._export_admitted_ns.pop(command.request_id, None)
                self._engine.abort_request(command.request_id)
                export.loop.call_soon_threadsafe(_set_exception, export.future, ValueError(
                    f"prefill of {command.request_id!r} aborted"))
                return
            if command.request_id in self._streams:
                self._engine.abort_request(command.request_id)
                self._send(command.request_id, SeqUpdate(command.request_id, (), "", 0, True, "abort"))
            return
        self._streams[command.request_id] = command.stream
        try:
            self._engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:  # the engine refused the request (too long, bad params)
            self._send(command.request_id, SeqUpdate(command.request_id, (), "", len(command.prompt_token_ids), True, "error", str(exc)))

    def _apply_handoff(self, command: _Export | _Import) -> None:
        if isinstance(command, _Export):
            try:
                self._engine.add_request(command.request_id, command.prompt_token_ids, command.params, kv_export=True)
            except ValueError as exc:
                command.loop.call_soon_threadsafe(_set_exception, command.future, exc)
                return
            self._exports[command.request_id] = command
            return
        self._streams[command.request_id] = command.stream
        try:
            output = self._engine.add_prefilled_request(
                command.request_id, command.prompt_token_ids, command.params, command.first_token_id,
                command.kv, command.first_positions, num_cached_tokens=command.num_cached_tokens)
        except ValueError as exc:
            self._send(command.request_id, SeqUpdate(command.request_id, (), "", len(command.prompt_token_ids), True,
                                                     "error", str(exc)))
            return
        self._deliver(output)

    def _finish_export(self, output: Any) -> None:
        """After a step: hand a finished prefill-role request's first token and saved KV to its future."""
        if not output.finished:
            return
        command = self._exports.pop(output.request_id)
        token_ids = output.outputs[0].token_ids
        exported = self._engine.pop_exported_kv(output.request_id)
        if exported is None or not token_ids:
            command.loop.call_soon_threadsafe(_set_exception, command.future, ValueError(
                f"prefill of {output.request_id!r} ended without its KV ({output.outputs[0].finish_reason})"))
            return
        num_tokens, kv = exported
        command.loop.call_soon_threadsafe(_set_result, command.future,
                                          (int(token_ids[0]), num_tokens, kv, output.num_cached_tokens or 0))

    def _deliver(self, output: Any) -> None:
        """Forward one ``RequestOutput`` (its single completion's per-step delta)."""
        if output.request_id in self._exports:
            self._finish_export(output)
            return
        if output.request_id not in self._streams:  # aborted earlier; the engine reports it once more
            return
        completion = output.outputs[0]
        update = SeqUpdate(output.request_id, tuple(completion.new_token_ids), completion.new_text,
                           len(output.prompt_token_ids), bool(output.finished), completion.finish_reason,
                           num_cached_tokens=getattr(output, "num_cached_tokens", None))
        self._send(output.request_id, update)

    def _send(self, request_id: str, update: SeqUpdate) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if update.finished:
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed (server shutting down)
            logger.debug("dropping update for %s: event loop closed", request_id)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
