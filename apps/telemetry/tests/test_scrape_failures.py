"""A failing scrape target is logged once per outage (start, recovery, gone), never once per poll."""

import logging

import httpx

from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.sources.scrape import DirectScrapeSource

LOGGER = "apps.telemetry.sources.scrape"


def test_a_target_refusing_connections_is_logged_when_it_starts_failing_and_when_it_recovers(caplog):
    up = {"a": False, "b": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up[request.url.host]:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return httpx.Response(200, text="ferry_num_requests_running 1\n")

    clock = iter(range(100, 200))
    source = DirectScrapeSource(client=httpx.Client(transport=httpx.MockTransport(handler)), clock=lambda: next(clock),
                                max_workers=1)  # one scrape at a time: a fixed order of clock readings
    a, b = ReplicaEndpoint("1", "stable", "r0", "http://a:1"), ReplicaEndpoint("1", "stable", "r1", "http://b:1")
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        for _ in range(5):  # five polls while a refuses
            source.refresh([a, b], 0)
        up["a"] = True
        source.refresh([a, b], 0)
        source.refresh([a, b], 0)
        up["b"] = False
        for _ in range(3):
            source.refresh([a, b], 0)
        source.refresh([a], 0)  # b's worker was removed while it failed
    finally:
        source.close()
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "scrape of http://a:1/metrics failing: ConnectError: [Errno 111] Connection refused "
        "(logged again when it recovers)",
        # a's polls at clock 100, 102, 104, 106, 108 failed; the one at 110 answered
        "scrape of http://a:1/metrics recovered after 5 failed scrapes over 10.0 s "
        "(last error: ConnectError: [Errno 111] Connection refused)",
        "scrape of http://b:1/metrics failing: ConnectError: [Errno 111] Connection refused "
        "(logged again when it recovers)",
        "scrape of http://b:1/metrics no longer asked for after 3 failed scrapes "
        "(last error: ConnectError: [Errno 111] Connection refused)",
    ]
    assert source.failures.outages == {}
