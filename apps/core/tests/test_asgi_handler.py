"""HTTP through the project's ASGI application: the middleware chain and the view in one worker-thread hop, and the
same answers as Django's own handlers (apps.core.asgi_handler)."""

import asyncio

import asgiref.sync
import pytest
from django.core.handlers.asgi import ASGIHandler
from django.test import Client
from django.utils.deprecation import MiddlewareMixin

from apps.core.asgi_handler import SyncChainASGIHandler

HOPS_PER_REQUEST = 3  # request_started, the chain with the view, response.close() (request_finished)


class AppendHeaderMiddleware(MiddlewareMixin):
    """Middleware of the most common kind (sync and async capable; two hops each in Django's ASGI handler)."""

    def process_request(self, request):
        request.seen_by_test_middleware = True

    def process_response(self, request, response):
        response["X-Test-Middleware"] = "yes" if request.seen_by_test_middleware else "no"
        return response


def asgi_get(app, path, headers=()):
    """One GET through ``app`` on a new event loop: (status, headers, body, sync_to_async calls made)."""
    sent, hops = [], []
    original = asgiref.sync.SyncToAsync.__call__

    def counted(instance, *args, **kwargs):
        hops.append(getattr(instance.func, "__qualname__", repr(instance.func)))
        return original(instance, *args, **kwargs)

    async def run():
        done = asyncio.Event()
        requested = False

        async def receive():
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1"), *headers], "client": ("127.0.0.1", 50000),
                 "server": ("127.0.0.1", 8000)}
        await app(scope, receive, send)
        done.set()

    asgiref.sync.SyncToAsync.__call__ = counted
    try:
        asyncio.run(run())
    finally:
        asgiref.sync.SyncToAsync.__call__ = original
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:]), hops


@pytest.mark.parametrize("extra_middleware", [[], [f"{__name__}.AppendHeaderMiddleware"] * 3])
def test_a_request_crosses_to_a_worker_thread_three_times_whatever_the_middleware(settings, extra_middleware):
    """Django's handler hops per sync middleware step (more with each middleware added); this one does not."""
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, *extra_middleware]
    status, headers, body, hops = asgi_get(SyncChainASGIHandler(), "/api/v1/pools/")  # anonymous: 401, no query
    assert (status, len(hops)) == (401, HOPS_PER_REQUEST)
    assert "BaseHandler.get_response" in hops
    assert headers.get(b"X-Test-Middleware") == (b"yes" if extra_middleware else None)
    stock_status, _, stock_body, stock_hops = asgi_get(ASGIHandler(), "/api/v1/pools/")
    assert (stock_status, stock_body) == (status, body)
    assert len(stock_hops) >= HOPS_PER_REQUEST + 10 + 2 * len(extra_middleware)


@pytest.mark.django_db(transaction=True)
def test_the_project_application_answers_the_api_as_the_test_client_does(operator_api, pool):
    """The same status, JSON body and headers for a list and a detail (the worker thread's database connection
    sees the committed rows and is given back)."""
    from controlplane.asgi import application

    auth = [(b"authorization", f"Token {operator_api.token}".encode())]
    for path in ("/api/v1/pools/", f"/api/v1/pools/{pool.pk}/", "/api/v1/clusters/", "/api/v1/pools/999999/"):
        expected = Client(HTTP_HOST="127.0.0.1", HTTP_AUTHORIZATION=f"Token {operator_api.token}").get(path)
        status, headers, body, hops = asgi_get(application, path, auth)
        assert (status, body, len(hops)) == (expected.status_code, expected.content, HOPS_PER_REQUEST), path
        assert {k.decode().lower(): v.decode() for k, v in headers.items()} == {
            k.lower(): v for k, v in expected.items()}, path
