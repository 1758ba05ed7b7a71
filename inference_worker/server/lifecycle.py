"""Running a worker server: background model loading and SIGTERM drain on uvicorn.

Startup: the listener opens first (``/health`` answers, ``/ready`` says ``loading``) while a
thread loads the model; when it is loaded the engine loop starts and readiness turns true.

A model that fails to load is fatal: the error is logged, written to the termination message
file (``FERRY_TERMINATION_MESSAGE_PATH``: the Kubernetes convention, ``/dev/termination-log`` in
the pod manifests, a per-process file under the local agent) and the process exits with
:data:`EXIT_MODEL_LOAD_FAILED`. A worker that stayed up with only ``/health`` saying why looked
"alive" with 0 restarts; exiting lets the kubelet (CrashLoopBackOff) or the control plane's
reconcile (local agent) restart it with backoff, and the message names the error.

SIGTERM (or the first SIGINT) starts a drain instead of uvicorn's immediate shutdown:

1. readiness turns false (``/ready`` 503) so load balancers stop sending traffic;
2. the listener stays open and new completion requests get 503 ``draining``;
3. in-flight requests run to completion for up to :func:`drain_wait_s` of ``drain_timeout_s``; requests
   still running then are aborted and end with ``finish_reason: "abort"`` (streams still get ``[DONE]``);
4. uvicorn then shuts down and the process exits 0.

``drain_timeout_s`` is the whole SIGTERM -> exit budget: the local agent SIGKILLs the worker when it runs out
and Kubernetes' ``terminationGracePeriodSeconds`` is the same number. So the wait for in-flight requests
stops :data:`ABORT_GRACE_S` + :data:`EXIT_MARGIN_S` before it, leaving the aborted streams time to send their
last event and the process time to exit. (Waiting the whole budget made the agent's SIGKILL land while the
aborts were being sent: clients got streams cut mid-event instead of ``finish_reason: "abort"``.)

A second signal during the drain forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from inference_worker.server.app import create_app
from inference_worker.server.state import ServedModel, ServerState

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 2.0
"""After a drain timeout, how long aborted requests get to send their last chunk."""

EXIT_MARGIN_S = 1.0
"""Seconds the drain leaves, after the abort grace, for uvicorn to close connections and the process to exit."""


def drain_wait_s(drain_timeout_s: float) -> float:
    """Seconds a draining worker waits for in-flight requests before it aborts them: the SIGTERM -> exit budget
    ``drain_timeout_s`` less :data:`ABORT_GRACE_S` and :data:`EXIT_MARGIN_S`, at least 0 (module docstring).
    Examples: 10 -> 7, 300 -> 297, 1 -> 0."""
    return max(0.0, drain_timeout_s - ABORT_GRACE_S - EXIT_MARGIN_S)

EXIT_MODEL_LOAD_FAILED = 3
"""Exit status of a worker whose model failed to load (1 and 2 are Python's and argparse's)."""

TERMINATION_MESSAGE_ENV = "FERRY_TERMINATION_MESSAGE_PATH"
"""Environment variable naming the file a fatal error is written to (Kubernetes' terminationMessagePath)."""

TERMINATION_MESSAGE_MAX_BYTES = 4096
"""Kubernetes keeps at most 4096 bytes of a termination message; longer ones are cut here the same way."""


def write_termination_message(message: str, path: str | None = None) -> None:
    """Write ``message`` (cut to 4096 bytes) to ``path`` or ``$FERRY_TERMINATION_MESSAGE_PATH``; no path: nothing.

    Failures to write are logged, never raised: the process is on its way out.
    """
    path = path if path is not None else os.environ.get(TERMINATION_MESSAGE_ENV, "")
    if not path:
        return
    data = message.encode()[:TERMINATION_MESSAGE_MAX_BYTES]
    try:
        with open(path, "wb") as fh:
            fh.write(data)
    except OSError as exc:
        logger.warning("cannot write the termination message to %s: %s", path, exc)


class DrainingServer(uvicorn.Server):
    """uvicorn server whose SIGTERM/SIGINT handler drains the worker before exiting.

    Unlike ``uvicorn.Server.handle_exit`` it does not re-raise the signal after shutdown, so a
    drained worker exits with status 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.worker_state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.worker_state.pd is not None:  # the KV receiver listens before the HTTP port does
            await self.worker_state.pd.start()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.worker_state.draining or self._loop is None:
            logger.warning("signal %s during drain: exiting now", sig)
            self.force_exit = True
            self.should_exit = True
            return
        logger.info("signal %s: draining (up to %.1fs)", sig, self.worker_state.drain_timeout_s)
        self.worker_state.start_draining()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state = self.worker_state
        done = await state.wait_idle(drain_wait_s(state.drain_timeout_s))
        if not done:
            logger.warning("drain timeout: %d request(s) still in flight are aborted", state.num_in_flight)
            state.abort_all()  # they end with finish_reason "abort" rather than a cut connection
            await state.wait_idle(ABORT_GRACE_S)
        else:
            logger.info("drained: no request in flight")
        self.should_exit = True


def load_in_background(state: ServerState, loader: Callable[[], ServedModel],
                       on_error: Callable[[], None] | None = None) -> threading.Thread:
    """Run ``loader`` in a thread and publish its result (or its error) on ``state``.

    On a load error: ``state.load_error`` is set, the termination message written and ``on_error``
    called (``run_server`` passes one that stops the server, so the process exits non-zero).
    """

    def run() -> None:
        try:
            model = loader()
        except Exception as exc:  # noqa: BLE001 - thread boundary: any load failure is fatal to the worker
            logger.exception("model failed to load")
            state.set_load_error(f"{type(exc).__name__}: {exc}")
            write_termination_message(f"model failed to load: {state.load_error}")
            if on_error is not None:
                on_error()
            return
        model.engine_loop.start()
        state.set_model(model)
        logger.info("model loaded; worker ready")

    thread = threading.Thread(target=run, name="model-loader", daemon=True)
    thread.start()
    return thread


def run_server(state: ServerState, loader: Callable[[], ServedModel], *, host: str, port: int,
               log_level: str = "info") -> int:
    """Serve until drained; returns the process exit status: 0 after a clean drain,
    :data:`EXIT_MODEL_LOAD_FAILED` when the model failed to load (the server stops at once).

    Raises:
        OSError: the port cannot be bound.
    """
    # loop/http pinned: uvloop and httptools are installed for the web and the router; the worker keeps the stack it was tested on
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, lifespan="off", access_log=False, loop="asyncio", http="h11")
    server = DrainingServer(config, state)
    state.metrics.set_ready(False)

    def stop_after_load_error() -> None:
        logger.error("exiting with status %d: model failed to load: %s", EXIT_MODEL_LOAD_FAILED, state.load_error)
        server.should_exit = True

    load_in_background(state, loader, on_error=stop_after_load_error)
    server.run()
    if state.model is not None:
        state.model.engine_loop.stop()
    return EXIT_MODEL_LOAD_FAILED if state.load_error is not None else 0
