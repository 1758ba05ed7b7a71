"""The router's routing-table puller logs failures per streak, not per attempt.

At ``make run`` the router starts before the web answers: it logged ``routing table refresh ... failed`` every second
until then (a new user's report of noise in the launcher's output). The control plane here is httpx's MockTransport
answering as the web does: connection refused while it starts, 503 while its database is not ready, then the table.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry

from inference_worker.router.metrics import RouterMetrics
from inference_worker.router.source import STILL_FAILING_LOG_S, TableSource

URL = "http://127.0.0.1:8000/api/v1/routing-table/"
TABLE = {"version": 4, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
         "pools": [{"name": "decode", "role": "decode", "replicas": [{"name": "d0", "url": "http://d0",
                                                                     "track": "stable"}]}]}


class Web:
    """Answers the router's pulls from a script: an exception to raise, a status code, or the table."""

    def __init__(self, script: list):
        self.script = list(script)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Exception):
            raise step
        if step == 200:
            return httpx.Response(200, json=TABLE, headers={"ETag": '"t4"'})
        return httpx.Response(step, json={"detail": "starting"})


def pulls(script: list, attempts: int, *, step_s: float = 1.0) -> tuple[TableSource, list[bool], list[float]]:
    """``attempts`` refreshes of a source against ``Web(script)``, the clock advancing ``step_s`` each time."""
    now = [0.0]
    refused = httpx.ConnectError("All connection attempts failed")
    web = Web([refused if s == "refused" else s for s in script])

    async def go() -> list[bool]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(web)) as client:
            source = TableSource(URL, client=client, metrics=RouterMetrics(CollectorRegistry()), clock=lambda: now[0])
            out = []
            for _ in range(attempts):
                out.append(await source.refresh())
                now[0] += step_s
            return source, out

    source, applied = asyncio.run(go())
    return source, applied, now


def records(caplog) -> list[tuple[str, str]]:  # noqa: ANN001 - pytest's caplog
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "inference_worker.router.source"]


def test_before_the_web_answers_the_router_waits_quietly_and_says_once_when_the_table_came(caplog):
    caplog.set_level(logging.INFO, logger="inference_worker.router.source")
    source, applied, _ = pulls(["refused"] * 20 + [503] * 5 + [200], 27)
    assert applied == [False] * 25 + [True, False]  # the 27th pull: the same table again, not a change
    assert source.table.version == 4 and source.failures == 0
    assert records(caplog) == [
        ("INFO", f"waiting for the routing table from {URL} (All connection attempts failed); retrying every 1 s"),
        ("INFO", f"routing table from {URL}: v4 after 25 failed attempt(s) over 25 s"),
    ]  # nothing at WARNING: make run's router logs at warning level, so the start is silent


def test_a_streak_that_lasts_is_logged_again_every_minute_and_a_lost_web_once_when_it_starts(caplog):
    caplog.set_level(logging.INFO, logger="inference_worker.router.source")
    long_wait = int(STILL_FAILING_LOG_S) * 2 + 5
    pulls(["refused"], long_wait)
    assert [level for level, _ in records(caplog)] == ["INFO", "WARNING", "WARNING"]
    assert records(caplog)[1][1] == (f"routing table from {URL} still failing after 61 attempts over 60 s (no routing "
                                     "table yet): All connection attempts failed")
    caplog.clear()
    source, _, _ = pulls([200] + ["refused"] * 3 + [200], 6)  # the web goes away, then comes back
    assert records(caplog) == [
        ("WARNING", f"routing table refresh from {URL} failed: All connection attempts failed; keeping table v4, "
                    "retrying every 1 s"),
        ("INFO", f"routing table from {URL}: v4 after 3 failed attempt(s) over 3 s"),
    ]
    assert source.metrics.table_errors._value.get() == 3
