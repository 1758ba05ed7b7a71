"""Server shutdown without tracebacks from requests cut off mid-way.

When the web server stops (Ctrl-C of ``make run``; uvicorn after its graceful-shutdown timeout, daphne at once) it
cancels the requests still running. Django's
``ASGIHandler.handle`` is cancelled while it waits on its two child tasks and never collects them; the
``listen_for_disconnect`` child then sees the client's ``http.disconnect``, raises ``RequestAborted`` and asyncio
reports "Task exception was never retrieved" with a traceback when the task is collected. A client disconnect is
not an error (Django ignores ``RequestAborted`` itself whenever it collects the task), so :class:`QuietAborts`
installs an event-loop exception handler that drops exactly that report (logged at DEBUG) and passes every other
one on to the handler that was there before (asyncio's default logs it as before).
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from django.core.exceptions import RequestAborted

logger = logging.getLogger(__name__)
_quiet_loops: weakref.WeakSet = weakref.WeakSet()


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Wrap ``loop``'s exception handler (once per loop) so unretrieved ``RequestAborted`` tasks are not reported."""
    if loop in _quiet_loops:
        return
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if isinstance(context.get("exception"), RequestAborted):
            logger.debug("request aborted by its client while the server stopped: %s", context.get("message"))
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    _quiet_loops.add(loop)


class QuietAborts:
    """ASGI middleware: installs :func:`install` on the running loop at the first call, then calls ``app``."""

    def __init__(self, app):  # noqa: ANN001 - an ASGI application
        self.app = app

    async def __call__(self, scope, receive, send):  # noqa: ANN001, ANN204 - the ASGI signature
        install(asyncio.get_running_loop())
        return await self.app(scope, receive, send)
