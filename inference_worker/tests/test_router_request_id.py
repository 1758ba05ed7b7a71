"""A client's ``X-Request-Id`` (kept in the open slow-request ring, forwarded to the replica, stored by the poller):
cut to 128 characters, and replaced by a random id when it is not printable ASCII (httpx cannot send it on to the
replica: before, ``X-Request-Id: é`` made the router's forward raise UnicodeEncodeError)."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from inference_worker.router.app import Router, RouterConfig
from inference_worker.server.worker_auth import WorkerTokens
from inference_worker.tests.test_router_worker_token import NEW, table, worker


def send(tmp_path, request_id: bytes) -> tuple[int, list[str]]:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table(worker_token=NEW)))
    router = Router(RouterConfig(routing_table=str(path), scrape_interval_s=0, kv_index=False, max_attempts=1))
    with TestClient(router.app, raise_server_exceptions=False) as client:
        router.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=worker(WorkerTokens(NEW), [])))
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1},
                               headers={"X-Request-Id": request_id})
        ids = [rec["request_id"] for rec in client.get("/debug/slow-requests").json()["requests"]]
    return response.status_code, ids


def test_a_long_request_id_is_cut_to_128_characters(tmp_path):
    assert send(tmp_path, b"r" * 5000) == (200, ["r" * 128])


def test_a_non_ascii_request_id_is_replaced_and_the_request_still_served(tmp_path):
    status, ids = send(tmp_path, "é-1".encode())
    assert status == 200 and len(ids) == 1 and len(ids[0]) == 32 and int(ids[0], 16) >= 0
