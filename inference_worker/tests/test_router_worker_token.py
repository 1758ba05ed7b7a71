"""The router sends each pool's worker token from the routing table (issue 19), in-process: the router app under
TestClient, its upstream client pointed at a worker stand-in behind the worker's own auth middleware."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from inference_worker.router.app import Router, RouterConfig
from inference_worker.router.prefix_index import KVEventSubscriber, PrefixIndex
from inference_worker.router.table import RoutingTable, RoutingTableError
from inference_worker.server.worker_auth import WorkerAuthMiddleware, WorkerTokens

NEW, OLD = "new-pool-token-0123456789", "old-pool-token-0123456789"


def table(**tokens: str) -> dict:
    return {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
            "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1", **tokens,
                       "replicas": [{"name": "w0", "url": "http://w0", "track": "stable"}]}]}


def worker(accepted: WorkerTokens, seen: list[str | None]):
    """A worker stand-in: the real auth middleware around an app that answers every completion with 200."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"choices": []}'})

    middleware = WorkerAuthMiddleware(app, accepted)

    async def recording(scope, receive, send):
        seen.append(dict(scope["headers"]).get(b"authorization", b"").decode() or None)
        await middleware(scope, receive, send)

    return recording


def complete(tmp_path, routing_table: dict, accepted: WorkerTokens) -> tuple[httpx.Response, list, Router]:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(routing_table))
    router = Router(RouterConfig(routing_table=str(path), scrape_interval_s=0, kv_index=False, max_attempts=1))
    seen: list[str | None] = []
    with TestClient(router.app) as client:
        router.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=worker(accepted, seen)))
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1},
                               headers={"Authorization": "Bearer the-clients-own-key"})
    return response, seen, router


def test_the_router_sends_the_pools_token_and_never_the_clients_authorization(tmp_path):
    response, seen, _ = complete(tmp_path, table(worker_token=NEW), WorkerTokens(NEW))
    assert (response.status_code, response.json()) == (200, {"choices": []})
    assert seen == [f"Bearer {NEW}"]


def test_during_a_rotation_a_replica_not_yet_rolled_gets_the_previous_token_after_its_401(tmp_path):
    response, seen, _ = complete(tmp_path, table(worker_token=NEW, worker_token_previous=OLD), WorkerTokens(OLD))
    assert response.status_code == 200
    assert seen == [f"Bearer {NEW}", f"Bearer {OLD}"]


def test_a_replica_refusing_its_pools_token_is_a_502_counted_as_auth_never_a_401_to_the_client(tmp_path):
    response, seen, router = complete(tmp_path, table(worker_token=OLD), WorkerTokens(NEW))
    assert response.status_code == 502
    assert response.json()["error"]["message"] == "no replica answered (1 tried): w0 refused the pool's worker token (401)"
    assert seen == [f"Bearer {OLD}"]
    assert router.metrics.upstream_errors.labels(pool="decode", replica="w0", kind="auth")._value.get() == 1


def test_a_pool_without_a_token_sends_no_authorization_and_a_replicas_repr_hides_the_tokens():
    assert RoutingTable.from_dict(table()).replicas[0].auth_headers == {}
    parsed = RoutingTable.from_dict(table(worker_token=NEW, worker_token_previous=OLD))
    assert parsed.replicas[0].auth_headers == {"Authorization": f"Bearer {NEW}"}
    assert NEW not in repr(parsed) and OLD not in repr(parsed)  # logged tables and replicas never show them


@pytest.mark.parametrize("bad", [5, "has space", "é" * 20, ["x"]])
def test_a_malformed_token_in_the_table_is_refused(bad):
    with pytest.raises(RoutingTableError, match="worker_token and worker_token_previous must be printable ASCII"):
        RoutingTable.from_dict(table(worker_token=bad))


def test_the_kv_events_subscriber_sends_the_token_and_moves_to_the_previous_one_after_a_401():
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        ok = request.headers.get("authorization") == f"Bearer {OLD}"  # a replica not yet rolled
        return httpx.Response(200 if ok else 401, content=b"")

    async def run():
        index = PrefixIndex()
        index.retain({"w0": "v1"})
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            subscriber = KVEventSubscriber(index, "w0", "http://w0", client=client, tokens=(NEW, OLD))
            with pytest.raises(httpx.HTTPStatusError):
                await subscriber._stream_once()
            await subscriber._stream_once()

    asyncio.run(run())
    assert seen == [f"Bearer {NEW}", f"Bearer {OLD}"]
