"""Client API key use counts (issue 19): the poller turns the routers' ``ferry_router_requests_by_key_total`` into
each key's ``use_count`` and ``last_used_at``, per router, across restarts, with one write per used key per poll."""

import datetime

import pytest

from apps.accounts.models import ClientApiKey
from apps.telemetry.endpoints import RouterEndpoint
from apps.telemetry.key_uses import KeyUseCounter
from apps.telemetry.poller import TelemetryPoller
from apps.telemetry.sources.scrape import DirectScrapeSource, SampleStore
from apps.telemetry.testing import served_router_metrics

R1, R2 = RouterEndpoint("http://r1:8080"), RouterEndpoint("http://r2:8080")


def exposition(**counts):
    lines = ["# TYPE ferry_router_requests_by_key_total counter"]
    lines += [f'ferry_router_requests_by_key_total{{key="{k}"}} {v}' for k, v in counts.items()]
    return "\n".join(lines) + "\n"


def test_increase_per_router_with_baseline_new_series_and_restarts():
    store, counter = SampleStore(retention_s=60), KeyUseCounter()
    store.ingest(R1, exposition(a=10), 1.0)
    store.ingest(R2, "", 1.0)
    assert counter.increase(store) == {}  # first sight: a baseline, history unknown
    store.ingest(R1, exposition(a=13), 2.0)
    store.ingest(R2, exposition(a=2, b=1), 2.0)  # created since R2's previous good scrape: from 0
    assert counter.increase(store) == {"a": 5, "b": 1}
    store.ingest(R1, exposition(a=4), 3.0)  # R1 restarted: its counter starts again from 0
    store.ingest(R2, exposition(a=2, b=1), 3.0)
    assert counter.increase(store) == {"a": 4}
    store.mark_down(R1, 4.0)  # a failed scrape adds nothing
    assert counter.increase(store) == {}


@pytest.mark.django_db
def test_poller_adds_router_counts_to_the_key_rows(history):
    ClientApiKey.objects.create(name="team-a", prefix="fck_x", key_sha256="a" * 64)
    ClientApiKey.objects.create(name="team-b", prefix="fck_y", key_sha256="b" * 64, use_count=7)
    clock = [1_780_000_000.0]
    with served_router_metrics() as (metrics, router):
        metrics.requests_by_key.labels(key="team-a").inc(2)  # before the poller's first scrape: a baseline
        poller = TelemetryPoller(history=history, window_s=15, clock=lambda: clock[0], endpoints=lambda: [],
                                 routers=lambda: [router],
                                 router_source=DirectScrapeSource(retention_s=60, clock=lambda: clock[0]))
        poller.poll_once()
        metrics.requests_by_key.labels(key="team-a").inc(3)
        metrics.requests_by_key.labels(key="team-b").inc(1)
        metrics.requests_by_key.labels(key="file-only").inc(4)  # a router's own key: no row, ignored
        clock[0] += 1.0
        poller.poll_once()
        poller.close()
    rows = {k.name: (k.use_count, k.last_used_at) for k in ClientApiKey.objects.all()}
    at = datetime.datetime.fromtimestamp(clock[0], tz=datetime.UTC)
    assert rows == {"team-a": (3, at), "team-b": (8, at)}
