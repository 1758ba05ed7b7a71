"""Running a worker server: background model loading and SIGTERM drain on uvicorn.

Startup: the listener opens first (``/health`` answers, ``/ready`` says ``loading``) while a
thread loads the model; when it is loaded the engine loop starts and readiness turns true.

SIGTERM (or the first SIGINT) starts a drain instead of uvicorn's immediate shutdown:

1. readiness turns false (``/ready`` 503) so load balancers stop sending traffic;
2. the listener stays open and new completion requests get 503 ``draining``;
3. in-flight requests run to completion, bounded by ``drain_timeout_s``; requests still running
   then are aborted and end with ``finish_reason: "abort"`` (streams still get ``[DONE]``);
4. uvicorn then shuts down and the process exits 0.

A second signal during the drain forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from inference_worker.server.app import create_app
from inference_worker.server.state import ServedModel, ServerState

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 2.0
"""After a drain timeout, how long aborted requests get to send their last chunk."""


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
        done = await state.wait_idle(state.drain_timeout_s)
        if not done:
            logger.warning("drain timeout: %d request(s) still in flight are aborted", state.num_in_flight)
            state.abort_all()  # they end with finish_reason "abort" rather than a cut connection
            await state.wait_idle(ABORT_GRACE_S)
        else:
            logger.info("drained: no request in flight")
        self.should_exit = True


def load_in_background(state: ServerState, loader: Callable[[], ServedModel]) -> threading.Thread:
    """Run ``loader`` in a thread and publish its result (or its error) on ``state``."""

    def run() -> None:
        try:
            model = loader()
        except Exception as exc:  # noqa: BLE001 - thread boundary: any load failure is reported on /ready
            logger.exception("model failed to load")
            state.set_load_error(f"{type(exc).__name__}: {exc}")
            return
        model.engine_loop.start()
        state.set_model(model)
        logger.info("model loaded; worker ready")

    thread = threading.Thread(target=run, name="model-loader", daemon=True)
    thread.start()
    return thread


def run_server(state: ServerState, loader: Callable[[], ServedModel], *, host: str, port: int,
               log_level: str = "info") -> int:
    """Serve until drained; returns the process exit status (0 after a clean drain).

    Raises:
        OSError: the port cannot be bound.
    """
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, lifespan="off", access_log=False)
    server = DrainingServer(config, state)
    state.metrics.set_ready(False)
    load_in_background(state, loader)
    server.run()
    if state.model is not None:
        state.model.engine_loop.stop()
    return 0
