"""The router's per-replica load bookkeeping across one attempt (in process, upstream mocked with httpx).

Every :meth:`LoadTracker.begin` is closed by exactly one ``prefill_done`` and one ``end``, whatever the
attempt's outcome: a request that leaks as "before its first byte" would be charged as queued work forever.
"""

import asyncio

import httpx
import pytest

from inference_worker.router.app import Router, RouterConfig
from inference_worker.router.table import Replica

REPLICA = Replica(name="d0", url="http://d0", pool="decode", role="decode", track="stable", model_version="v1")


def attempt(status: int):
    router = Router(RouterConfig(routing_table="unused.json"))
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(status, stream=httpx.ByteStream(b"{}"))))

    async def run():
        try:
            return await router._attempt("POST", "/v1/completions", b"{}", {}, REPLICA, None, False,
                                         httpx.Timeout(5.0))
        finally:
            await router.client.aclose()

    return router, asyncio.run(run())


@pytest.mark.parametrize("status", [200, 503])
def test_an_attempt_without_prefill_tokens_releases_its_pending_request(status):
    router, outcome = attempt(status)
    loads = router.loads
    assert (loads.assigned["d0"], loads.in_flight["d0"], loads.pending_requests["d0"],
            loads.pending_prefill_tokens["d0"]) == (1, 0, 0, 0)
    assert (outcome.status_code if status == 200 else outcome) == (200 if status == 200 else ("d0 answered 503", 502))
