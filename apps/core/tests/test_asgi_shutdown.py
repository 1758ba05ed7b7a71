"""A request cut off by the server's shutdown leaves no "Task exception was never retrieved" traceback."""

import asyncio
import gc
import logging

from django.core.handlers.asgi import ASGIHandler

from apps.core.asgi_shutdown import QuietAborts


def _cut_off_request(app, child_error: BaseException | None = None) -> None:
    """Run ``app`` as the web server does at shutdown: the request is cancelled while it waits, then the client's
    disconnect arrives. The inner app starts Django's own ``listen_for_disconnect`` child task (or one raising
    ``child_error``) and waits, as ``ASGIHandler.handle`` does; nobody collects the child."""
    loop = asyncio.new_event_loop()

    async def inner(scope, receive, send):
        if child_error is None:
            asyncio.ensure_future(ASGIHandler().listen_for_disconnect(receive))
        else:
            async def failing():
                await receive()
                raise child_error
            asyncio.ensure_future(failing())
        await asyncio.Event().wait()

    async def scenario():
        inbox = asyncio.Queue()
        request = asyncio.ensure_future(app(inner)({"type": "http"}, inbox.get, None))
        await asyncio.sleep(0.01)
        request.cancel()  # daphne stopping
        await inbox.put({"type": "http.disconnect"})
        await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    gc.collect()  # the unretrieved child is reported when it is collected


def test_only_aborted_requests_are_silenced(caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")
    _cut_off_request(lambda inner: inner)  # Django alone: the traceback the user saw
    assert [r.getMessage().splitlines()[0] for r in caplog.records] == ["Task exception was never retrieved"]
    assert type(caplog.records[0].exc_info[1]).__name__ == "RequestAborted"
    caplog.clear()
    _cut_off_request(QuietAborts)
    assert caplog.records == []
    _cut_off_request(QuietAborts, child_error=ValueError("a real bug"))  # anything else is still reported
    assert [(r.getMessage().splitlines()[0], repr(r.exc_info[1])) for r in caplog.records] == [
        ("Task exception was never retrieved", "ValueError('a real bug')")]
