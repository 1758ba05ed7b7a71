"""Django's ASGI handler with the middleware chain and the view run as under WSGI: one thread hop per request.

Django's :class:`~django.core.handlers.asgi.ASGIHandler` builds its middleware chain in async mode. Every view
here is sync and so is most middleware, so each request crossed between the event loop and its worker thread
once per sync step: ``process_request``/``process_response`` of each ``MiddlewareMixin`` middleware, an
``async_to_sync`` back to the loop below WhiteNoise (sync only), ``process_view`` and the view itself — 16
``sync_to_async`` calls for ``GET /api/v1/pools/`` (issue 21: per-request cost). :class:`SyncChainASGIHandler`
builds the chain in sync mode (as Django's WSGI handler does) and runs it, view included, in one
``sync_to_async`` call; with the ``request_started`` signal and ``response.close()`` (``request_finished``) that
makes 3 per request, whatever middleware is added. Measured in-process (``bench/api_profile.py --asgi``; a
request that stops in DRF's authentication, 401, no query): 2.5 ms of CPU with Django's handler, 1.3 ms with this
one.

Everything else is Django's ASGI handler unchanged: the request is an ``ASGIRequest`` (``request.scope``), each
request gets its own worker thread (``ThreadSensitiveContext``: a slow view does not hold up the others, and the
thread's database connection is returned to the pool by ``request_finished``), a client disconnect cancels the
response, streaming responses stream. An ``async def`` view still works (Django's sync path runs it with
``async_to_sync``), at the cost of that hop; Ferry has none.
"""

from __future__ import annotations

import django
from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.http import FileResponse, HttpRequest, HttpResponseBase


class SyncChainASGIHandler(ASGIHandler):
    """An ASGI application serving Django over HTTP with the middleware chain and view in one worker thread."""

    def load_middleware(self, is_async: bool = False) -> None:
        """Build the chain in sync mode whatever ``is_async`` says (``ASGIHandler.__init__`` asks for async)."""
        super().load_middleware(is_async=False)

    async def run_get_response(self, request: HttpRequest) -> HttpResponseBase:
        """The response of ``request``: the whole sync chain in one call on the request's worker thread."""
        response = await sync_to_async(self.get_response, thread_sensitive=True)(request)
        response._handler_class = self.__class__
        if isinstance(response, FileResponse):  # as Django's: the server chunks, so bigger reads
            response.block_size = self.chunk_size
        return response


def sync_chain_asgi_application() -> SyncChainASGIHandler:
    """Set up Django and return its HTTP ASGI application (what ``django.core.asgi.get_asgi_application`` does,
    with :class:`SyncChainASGIHandler`)."""
    django.setup(set_prefix=False)
    return SyncChainASGIHandler()
