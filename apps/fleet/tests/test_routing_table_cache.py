"""The routing table's Redis copy and the ASGI fast path routers are served from (apps.fleet.routing_table_cache)."""

import asyncio
import datetime
import json

import pytest

from apps.fleet.routing_table_cache import (
    KEY,
    LINK_LOAD_KEY,
    LINK_LOAD_PATH,
    PATH,
    RoutingTableFastPath,
    _client,
    link_load_body,
    link_load_store,
    routing_table_cache_clear,
    routing_table_cache_store,
    routing_table_etag,
)
from apps.fleet.services import routing_table_publish
from inference_worker.tests.support.worker import free_port

TOKEN = "svc-token-fast-path"


class Downstream:
    """The ASGI app behind the fast path (Django in production): records what reached it, answers 299."""

    def __init__(self):
        self.paths: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send):
        self.paths.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"django"})


def asgi_get(app, *, path=PATH, method="GET", headers=()):
    """One request through ``app`` on the app's event loop (``app.loop``): (status, headers, body)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    app.loop.run_until_complete(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


@pytest.fixture
def fast_path(settings, db):
    settings.FERRY_SERVICE_TOKEN = TOKEN
    routing_table_cache_clear()
    downstream = Downstream()
    loop = asyncio.new_event_loop()  # one per test: the fast path's Redis pool belongs to its first loop
    app = RoutingTableFastPath(downstream)
    app.loop = loop
    yield app, downstream
    loop.close()
    routing_table_cache_clear()


def test_a_published_table_reaches_the_service_token_from_redis_without_django_or_the_database(
        fast_path, client, django_capture_on_commit_callbacks, django_assert_num_queries):
    app, downstream = fast_path
    with django_capture_on_commit_callbacks(execute=True):
        table, changed = routing_table_publish()
    assert changed
    with django_assert_num_queries(0):
        status, headers, body = asgi_get(app, headers=[("Authorization", f"Bearer {TOKEN}")])
        etag = headers[b"etag"].decode()
        not_modified = asgi_get(app, headers=[("Authorization", f"bearer {TOKEN}"), ("If-None-Match", etag)])
    assert downstream.paths == []
    view = client.get(PATH, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert (status, headers[b"content-type"], etag) == (200, b"application/json", view["ETag"])
    assert json.loads(body) == view.json() == {"version": table.version, **table.content}
    assert not_modified == (304, {b"etag": etag.encode(), b"x-content-type-options": b"nosniff"}, b"")


@pytest.mark.parametrize(("method", "path", "authorization"), [
    ("GET", PATH, None),                           # anonymous: Django answers 401
    ("GET", PATH, "Bearer wrong-token"),           # not the service token
    ("GET", PATH, "Token some-users-token"),       # a user's API token: Django authenticates it
    ("GET", PATH, f"Bearer {TOKEN}x"),             # a longer token sharing the prefix
    ("POST", PATH, f"Bearer {TOKEN}"),             # not a read
    ("GET", "/api/v1/pools/", f"Bearer {TOKEN}"),  # another endpoint
])
def test_every_other_request_goes_to_django(fast_path, django_capture_on_commit_callbacks, method, path,
                                            authorization):
    app, downstream = fast_path
    with django_capture_on_commit_callbacks(execute=True):
        routing_table_publish()
    headers = [("Authorization", authorization)] if authorization else []
    assert asgi_get(app, method=method, path=path, headers=headers) == (299, {}, b"django")
    assert downstream.paths == [(method, path)]


def test_without_a_cached_table_django_answers_and_refills_the_cache(fast_path, client):
    app, downstream = fast_path
    routing_table_publish()  # its on-commit copy never runs inside the test's transaction
    auth = [("Authorization", f"Bearer {TOKEN}")]
    assert asgi_get(app, headers=auth)[0] == 299
    view = client.get(PATH, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert view.status_code == 200
    assert asgi_get(app, headers=[*auth, ("If-None-Match", view["ETag"])])[0] == 304
    assert downstream.paths == [("GET", PATH)]


def test_redis_down_falls_back_to_django_and_publishing_still_succeeds(fast_path, settings, caplog):
    app, downstream = fast_path
    redis_url, settings.REDIS_URL = settings.REDIS_URL, f"redis://127.0.0.1:{free_port()}/0"
    app, app.loop = RoutingTableFastPath(downstream), app.loop
    assert asgi_get(app, headers=[("Authorization", f"Bearer {TOKEN}")])[0] == 299
    now = datetime.datetime.now(datetime.UTC)
    assert routing_table_cache_store(version=3, digest="ab" * 32, content={}, published_at=now) is False
    assert "routing table v3 not cached" in caplog.text
    settings.REDIS_URL = redis_url  # the fixture's clean-up reaches the real Redis


def test_a_table_published_earlier_never_replaces_a_later_one_but_a_new_database_does(fast_path):
    t0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
    second = datetime.timedelta(seconds=1)
    assert routing_table_cache_store(version=6, digest="66" * 32, content={"pools": []}, published_at=t0 + second)
    # v5 committed first but copied last (two publishers): v6 stays
    assert not routing_table_cache_store(version=5, digest="55" * 32, content={"pools": []}, published_at=t0)
    with _client() as redis:
        assert redis.hget(KEY, "etag").decode() == routing_table_etag(6, "66" * 32)
        assert 0 < redis.ttl(KEY) <= 60
    # a new database publishes v1 later: it replaces v6
    assert routing_table_cache_store(version=1, digest="11" * 32, content={"pools": []}, published_at=t0 + 2 * second)
    with _client() as redis:
        assert json.loads(redis.hget(KEY, "body")) == {"version": 1, "pools": []}


LOAD = {"at": 1_780_000_000.0, "window_s": 30.0, "links": [
    {"source": "dc-b", "target": "dc-a", "bandwidth_gbps": 10.0, "kv_gbps": 2.5, "utilisation": 0.25}]}


def test_the_link_load_document_reaches_routers_from_redis_with_an_etag_and_viewers_through_django(
        fast_path, client, viewer_api, django_assert_num_queries):
    app, downstream = fast_path
    auth = [("Authorization", f"Bearer {TOKEN}")]
    assert asgi_get(app, path=LINK_LOAD_PATH, headers=auth)[0] == 299  # none stored yet: Django's turn
    assert client.get(LINK_LOAD_PATH, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 404
    assert link_load_store(LOAD)
    body, etag = link_load_body(LOAD)
    with django_assert_num_queries(0):
        status, headers, served = asgi_get(app, path=LINK_LOAD_PATH, headers=auth)
        not_modified = asgi_get(app, path=LINK_LOAD_PATH, headers=[*auth, ("If-None-Match", etag)])
    assert (status, headers[b"etag"].decode(), served) == (200, etag, body)
    assert json.loads(served) == LOAD
    assert not_modified[0] == 304
    assert downstream.paths == [("GET", LINK_LOAD_PATH)]
    view = viewer_api.get(LINK_LOAD_PATH)
    assert (view.status_code, view.json()) == (200, LOAD)
    assert client.get(LINK_LOAD_PATH).status_code == 401
    with _client() as redis:
        assert 0 < redis.ttl(LINK_LOAD_KEY) <= 10  # a stopped poller's measurement expires
