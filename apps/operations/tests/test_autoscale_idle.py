"""Zero traffic is not "no data": a TTFT-scaled pool whose request counters answer 0 for the whole
scale-down window scales to its minimum; a poll whose replica did not answer restarts the wait.

The whole path is real: a worker's metrics registry served over HTTP, the poller's direct scrape
into the Redis signal history, and the autoscaler reading that history (fake clock, real time).
"""

import time
from datetime import UTC, datetime

import pytest
from prometheus_client import start_http_server

from apps.operations.autoscale import pool_autoscale
from apps.operations.models import Action
from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.poller import TelemetryPoller, scrape_retention_s
from apps.telemetry.sources.scrape import DirectScrapeSource
from inference_worker.metrics import WorkerMetrics

pytestmark = pytest.mark.django_db


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def idle_pool(make_pool, settings):
    settings.FERRY_AUTOSCALE_MAX_SIGNAL_AGE_S = 6.0  # polls 5 s apart are continuous; 10 s is a gap
    return make_pool(name="decode-idle", replicas=4, autoscaling_enabled=True, min_replicas=1, max_replicas=8,
                     autoscaling_signal="ttft_p99_seconds", autoscaling_target=2.0, scale_down_stabilization_s=60)


@pytest.fixture
def worker(idle_pool):
    """An idle worker's real metrics registry over HTTP: ready, no request ever served."""
    metrics = WorkerMetrics({"pool": idle_pool.name, "track": "stable", "replica": "r0", "role": "decode"})
    metrics.set_ready(True)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    yield ReplicaEndpoint(str(idle_pool.pk), "stable", "r0", f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


def _first_scale(pool, worker, history, *, unreachable_at_s=None, until_s=120):
    """Poll and evaluate every 5 s from t=0; returns ``(t, replicas)`` of the first scale Action."""
    start = float(int(time.time()) - until_s - 5)  # whole seconds (datetimes keep microseconds); recent:
    # history reads keep the last 15 minutes of real time
    clock = Clock(start)
    dead = ReplicaEndpoint(worker.pool_id, worker.track, worker.replica, "http://127.0.0.1:9")
    poller = TelemetryPoller(
        history=history, window_s=10, clock=clock, routers=lambda: [],
        endpoints=lambda: [dead if clock.t - start == unreachable_at_s else worker],
        source_factory=lambda choice, window_s, routers: DirectScrapeSource(
            retention_s=scrape_retention_s(window_s), routers=routers, clock=clock),
    )
    try:
        for t_s in range(0, until_s + 1, 5):
            clock.t = start + t_s
            record = poller.poll_once()[pool.pk]
            assert record["signals"]["ttft_p99_s"] is None  # no request ever finished: the quantile is empty
            _, action = pool_autoscale(pool, now=_dt(clock.t), history=history)
            if action is not None:
                return t_s, action.params["replicas"], action.params["reason"]
    finally:
        poller.close()
    return None


def _dt(seconds):
    return datetime.fromtimestamp(seconds, tz=UTC)


def test_zero_request_rate_throughout_the_window_scales_a_latency_pool_to_min(idle_pool, worker, history):
    # t=0: one scrape, no rate yet (None: unreadable). From t=5 the counters answer 0. The first
    # window [t-60, t] without the t=0 record is t=65: hold at 4 until then, then scale to 1.
    t_s, replicas, reason = _first_scale(idle_pool, worker, history)
    assert (t_s, replicas) == (65, 1)
    assert reason == ("idle: request rate 0 throughout the 60s scale-down window, ttft_p99_seconds has no "
                      "requests -> 1")
    assert Action.objects.filter(pool=idle_pool, kind="pool.scale").count() == 1


def test_a_poll_without_an_answering_replica_restarts_the_idle_window(idle_pool, worker, history):
    # The replica does not answer the t=30 scrape: its old counter samples still give a rate of 0,
    # but no replica is ready, so that record is not "idle"; at t=35 the 10 s rate window (25, 35]
    # holds one sample only (None). The first window [t-60, t] after both: t=100.
    t_s, replicas, _ = _first_scale(idle_pool, worker, history, unreachable_at_s=30)
    assert (t_s, replicas) == (100, 1)


def test_an_unreadable_source_holds(idle_pool, history):
    # A replica that never answers: no rate, no ready count -> hold for the whole run.
    dead = ReplicaEndpoint(str(idle_pool.pk), "stable", "r0", "http://127.0.0.1:9")
    assert _first_scale(idle_pool, dead, history) is None
    assert not Action.objects.filter(pool=idle_pool).exists()
