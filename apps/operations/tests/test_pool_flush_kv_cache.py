"""``POST /api/v1/pools/{id}/flush-kv-cache/`` and the ``pool.flush_kv_cache`` handler (issue 18).

The handler's replicas come from a backend whose ``observe`` names two live workers served over real HTTP on
loopback (the stdlib server, checking the signature with the worker's own ``verify_signature``) and a dead one;
the live-stack browser test flushes real workers through the agent.
"""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from apps.operations import pool_actions
from apps.operations.models import Action
from apps.operations.pools import pool_flush_kv_cache
from apps.operations.services import action_retry
from apps.operations.tasks import execute_action
from apps.orchestrators.base import ObservedReplica, ObservedState, ObservedTrack
from inference_worker import http_headers
from inference_worker.server.errors import OpenAIError
from inference_worker.server.signing import verify_signature
from inference_worker.server.worker_auth import WorkerTokens

pytestmark = pytest.mark.django_db
SECRET = "flush-test-link-secret-0123456789"


class ResetWorker:
    """``POST /admin/kv-cache/reset`` on a loopback port: 200 ``{"cleared_blocks": n}`` for a valid signature
    (401 otherwise), or always ``status`` when given (a worker that refuses); ``raw_body`` replaces the JSON
    answer (something else listening at the replica's endpoint)."""

    def __init__(self, cleared_blocks: int, status: int | None = None, raw_body: bytes | None = None,
                 tokens: WorkerTokens | None = None):
        self.calls: list[str] = []
        self.authorizations: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.calls.append(self.path)
                outer.authorizations.append(self.headers.get("authorization"))
                code, payload = status or 200, {"cleared_blocks": cleared_blocks}
                if status is not None:
                    payload = {"error": {"message": "the worker is not ready: loading"}}
                elif tokens is not None:  # a worker with a worker token: the bearer only (worker_auth)
                    if not tokens.accepts(self.headers.get("authorization")):
                        code, payload = 401, {"error": {"message": "invalid worker token"}}
                else:
                    try:
                        verify_signature(SECRET.encode(), body, self.headers.get(http_headers.KV_SIGNATURE))
                    except OpenAIError as exc:
                        code, payload = exc.status_code, {"error": {"message": str(exc)}}
                data = json.dumps(payload).encode() if raw_body is None else raw_body
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ObservingBackend:
    """A backend whose ``observe`` reports the given replicas on track stable."""

    def __init__(self, replicas: list[ObservedReplica]):
        self.replicas = replicas

    def observe(self, pool):  # noqa: ANN001, ANN201 - OrchestratorBackend's signature
        track = ObservedTrack("stable", len(self.replicas), sum(r.ready for r in self.replicas), tuple(self.replicas))
        return ObservedState(pool.pool_name, {"stable": track})


@pytest.fixture
def workers(monkeypatch, settings):
    settings.FERRY_KV_LINK_SECRET = SECRET
    good, refusing = ResetWorker(cleared_blocks=7), ResetWorker(cleared_blocks=0, status=503)
    replicas = [ObservedReplica("decode-a-0", "stable", good.url, True, True, "v1"),
                ObservedReplica("decode-a-1", "stable", refusing.url, True, True, "v1"),
                ObservedReplica("decode-a-2", "stable", "http://127.0.0.1:9", False, False, "v1", exit_code=1)]
    backend = ObservingBackend(replicas)
    monkeypatch.setattr(pool_actions, "backend_session", lambda cluster: contextlib.nullcontext(backend))
    yield {"good": good, "refusing": refusing, "backend": backend}
    good.close()
    refusing.close()


def test_operator_requests_a_flush_as_an_action_recorded_with_the_requester(operator_api, pool):
    r = operator_api.post(f"/api/v1/pools/{pool.pk}/flush-kv-cache/")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert (body["kind"], body["status"], body["params"], body["pool"], body["requested_by"]) == (
        "pool.flush_kv_cache", "pending", {}, pool.pk, "otto")
    second = operator_api.post(f"/api/v1/pools/{pool.pk}/flush-kv-cache/")
    assert second.status_code == 409  # one Action at a time per pool
    assert f"already has action #{body['id']} (pool.flush_kv_cache, pending)" in second.json()["detail"]


def test_viewer_cannot_flush(viewer_api, pool):
    assert viewer_api.post(f"/api/v1/pools/{pool.pk}/flush-kv-cache/").status_code == 403
    assert not Action.objects.exists()


def test_flush_failure_names_each_replica_and_its_reason_and_a_retry_flushes_again(workers, pool):
    action, _ = pool_flush_kv_cache(pool=pool)
    assert execute_action.apply(args=[action.pk]).get() == "failed"
    action.refresh_from_db()
    assert action.retryable is True
    assert action.error.startswith("KV cache flush failed on 1 of 2 replicas: decode-a-1: HTTP 503: ")
    assert "the worker is not ready: loading" in action.error
    assert "flushed decode-a-0: 7 blocks cleared" in [line["message"] for line in action.log]
    assert workers["good"].calls == workers["refusing"].calls == ["/admin/kv-cache/reset"]  # the dead one skipped

    workers["backend"].replicas.pop(1)  # the refusing replica went away: the retry succeeds
    retry, _ = action_retry(action=action)
    assert execute_action.apply(args=[retry.pk]).get() == "succeeded"
    assert workers["good"].calls == ["/admin/kv-cache/reset"] * 2


def test_flush_with_a_wrong_secret_is_the_workers_401_recorded(workers, pool, settings):
    settings.FERRY_KV_LINK_SECRET = "not-the-workers-secret-0123456789"
    workers["backend"].replicas.pop(1)
    action, _ = pool_flush_kv_cache(pool=pool)
    assert execute_action.apply(args=[action.pk]).get() == "failed"
    action.refresh_from_db()
    assert action.error.startswith("KV cache flush failed on 1 of 1 replicas: decode-a-0: HTTP 401: ")


def test_flush_without_a_link_secret_sends_the_pools_token_alone_and_a_token_less_worker_refuses_it(
        workers, pool, settings):
    settings.FERRY_KV_LINK_SECRET = ""
    workers["backend"].replicas.pop(1)
    action, _ = pool_flush_kv_cache(pool=pool)
    assert execute_action.apply(args=[action.pk]).get() == "failed"  # this stand-in checks the signature only
    action.refresh_from_db()
    assert action.error.startswith("KV cache flush failed on 1 of 1 replicas: decode-a-0: HTTP 401: ")
    assert workers["good"].authorizations == [f"Bearer {pool.worker_token}"]


def test_flush_sends_the_pools_worker_token_and_the_previous_one_to_a_replica_not_yet_rolled(workers, pool, settings):
    settings.FERRY_KV_LINK_SECRET = ""
    old = pool.worker_token
    pool.worker_token_previous, pool.worker_token = old, "rotated-pool-token-0123456789"
    pool.save()
    rolled = ResetWorker(cleared_blocks=3, tokens=WorkerTokens(pool.worker_token, old))
    not_rolled = ResetWorker(cleared_blocks=4, tokens=WorkerTokens(old))
    try:
        workers["backend"].replicas[:] = [ObservedReplica("decode-a-0", "stable", rolled.url, True, True, "v1"),
                                          ObservedReplica("decode-a-1", "stable", not_rolled.url, True, True, "v1")]
        action, _ = pool_flush_kv_cache(pool=pool)
        assert execute_action.apply(args=[action.pk]).get() == "succeeded"
        action.refresh_from_db()
        assert [line["message"] for line in action.log if line["message"].startswith("flushed")] == [
            "flushed decode-a-0: 3 blocks cleared", "flushed decode-a-1: 4 blocks cleared"]
        assert rolled.authorizations == [f"Bearer {pool.worker_token}"]
        assert not_rolled.authorizations == [f"Bearer {pool.worker_token}", f"Bearer {old}"]
    finally:
        rolled.close()
        not_rolled.close()


@pytest.mark.parametrize("raw_body", [b"<html>502 Bad Gateway</html>", b"[7]", b'"flushed"', b"{}", b"null"])
def test_a_replica_answering_200_without_cleared_blocks_fails_alone_and_the_others_are_flushed(
        workers, pool, raw_body):
    # Something else at a replica's endpoint (a proxy's page, another service) answers 200 with another body:
    # the flush must go on to the other replicas and record a retryable failure naming that replica, not stop
    # at the first one with a JSON decoding error and a non-retryable Action.
    odd = ResetWorker(cleared_blocks=0, raw_body=raw_body)
    try:
        workers["backend"].replicas[1:] = [  # sorted by name, both are asked before the good one
            ObservedReplica("decode-0-odd", "stable", odd.url, True, True, "v1"),
            ObservedReplica("decode-1-url", "stable", "http://[::1", True, True, "v1")]
        action, _ = pool_flush_kv_cache(pool=pool)
        assert execute_action.apply(args=[action.pk]).get() == "failed"
        action.refresh_from_db()
        assert action.retryable is True
        assert action.error.startswith("KV cache flush failed on 2 of 3 replicas: decode-0-odd: HTTP 200 without "
                                       "cleared_blocks: "), action.error
        assert "; decode-1-url: InvalidURL: " in action.error
        assert [line["message"] for line in action.log if line["message"].startswith("flushed")] == [
            "flushed decode-a-0: 7 blocks cleared"]
        assert odd.calls == workers["good"].calls == ["/admin/kv-cache/reset"]
    finally:
        odd.close()
