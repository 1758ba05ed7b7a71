"""The poller streams signals with increasing sequence numbers over the real Redis channel layer,
and its 15-minute history (and numbering) survives a restart."""

import asyncio
import io
import itertools
import threading
import time
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client import start_http_server

from apps.telemetry.broadcast import FLEET_GROUP, pool_group
from apps.telemetry.endpoints import ReplicaEndpoint, set_endpoint_provider
from apps.telemetry.history import SignalHistory
from apps.telemetry.models import Alert
from apps.telemetry.poller import TelemetryPoller, significant
from apps.telemetry.selectors import telemetry_signal
from apps.telemetry.services import alert_rules_load_defaults
from apps.telemetry.sources.scrape import DirectScrapeSource
from apps.telemetry.testing import served_router_metrics
from inference_worker.metrics import WorkerMetrics


@pytest.fixture
def exporter(pool):
    """A worker's real metrics registry served over HTTP on a free loopback port.

    Loads the default rules again: transactional tests flush what the data migration created.
    """
    alert_rules_load_defaults()
    metrics = WorkerMetrics({"pool": pool.name, "track": "stable", "replica": "r0", "role": "decode"})
    metrics.set_ready(True)
    metrics.set_engine_state(num_waiting=2, num_running=1, kv_cache_usage=0.97, busy_ratio=0.5)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield metrics, ReplicaEndpoint(str(pool.pk), "stable", "r0", url)
    server.shutdown()
    server.server_close()


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def loop():
    """One event loop for the test's receives, like a consumer's: channels-redis finishes each
    receive with a clean-up task on the loop, which a per-call loop would cut short."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def receive(loop, channel, n):
    layer = get_channel_layer()

    async def collect():
        return [await asyncio.wait_for(layer.receive(channel), 10) for _ in range(n)]

    return asyncio.run_coroutine_threadsafe(collect(), loop).result(timeout=30)


def subscribe(group):
    """Join ``group`` with a plain (not process-local) channel: read directly from Redis each time."""
    layer = get_channel_layer()
    channel = f"telemetry-test-{uuid.uuid4().hex}"
    async_to_sync(layer.group_add)(group, channel)
    return channel


@pytest.mark.django_db(transaction=True)
def test_poller_publishes_increasing_seq_and_history_survives_restart(pool, exporter, history, loop):
    _, endpoint = exporter
    pool_channel, fleet_channel = subscribe(pool_group(pool.pk)), subscribe(FLEET_GROUP)
    clock = Clock(1_780_000_000.0)
    poller = TelemetryPoller(history=history, window_s=10, clock=clock, endpoints=lambda: [endpoint])
    for _ in range(3):
        poller.poll_once()
        clock.t += 1.0
    # KV usage 0.97 > 0.95: the critical rule fired on the first poll (for_seconds 0) -> an alert
    # message numbered in the same sequence as the signals.
    messages = receive(loop, pool_channel, 4)
    assert [(m["type"], m["seq"]) for m in messages] == [
        ("telemetry.signals", 1), ("telemetry.alert", 2), ("telemetry.signals", 3), ("telemetry.signals", 4)]
    first = messages[0]
    assert first["pool_id"] == pool.pk and first["source"] == "scrape"
    assert first["signals"]["num_requests_waiting"] == 2.0
    assert first["signals"]["ready_replicas"] == 1.0
    assert first["signals"]["request_rate_per_s"] is None  # one scrape: no rate yet, not 0
    assert first["tracks"]["stable"]["kv_cache_usage"] == 0.97
    assert messages[1]["alert"]["rule"] == "kv-cache-usage-critical"
    fleet = receive(loop, fleet_channel, 4)
    assert [m["seq"] for m in fleet] == [1, 2, 3, 4]
    # The alert goes out while the pool is processed, before that poll's fleet summary.
    assert [m["type"] for m in fleet] == ["telemetry.alert", "telemetry.fleet", "telemetry.fleet", "telemetry.fleet"]
    poller.close()

    # Restart: a new poller (and a new Redis client) continues the numbering and keeps history.
    restarted = TelemetryPoller(history=SignalHistory(prefix=history.prefix), window_s=10, clock=clock,
                                endpoints=lambda: [endpoint])
    assert restarted.evaluator.firing() == {
        (str(Alert.objects.get().rule_id), str(pool.pk)): 1_780_000_000.0}  # restored, not re-fired
    restarted.poll_once()
    (message,) = receive(loop, pool_channel, 1)
    assert (message["type"], message["seq"]) == ("telemetry.signals", 5)
    # Scraped samples live in the poller's memory: right after a restart a rate has one sample (no data).
    assert message["signals"]["request_rate_per_s"] is None
    stored = history.read(f"pool:{pool.pk}")
    assert [r["seq"] for r in stored] == [1, 3, 4, 5]
    assert Alert.objects.count() == 1
    restarted.close()


@pytest.mark.django_db(transaction=True)
def test_history_keeps_fifteen_minutes(pool, exporter, history):
    _, endpoint = exporter
    clock = Clock(1_780_000_000.0)
    poller = TelemetryPoller(history=history, window_s=10, clock=clock, endpoints=lambda: [endpoint])
    for offset in (0.0, 1.0, 450.0, 900.0, 901.5):
        clock.t = 1_780_000_000.0 + offset
        poller.poll_once()
    poller.close()
    # At t0+901.5 everything older than t0+1.5 is trimmed: t0 and t0+1 are gone.
    assert [r["at"] - 1_780_000_000.0 for r in history.read(f"pool:{pool.pk}")] == [450.0, 900.0, 901.5]
    # the fleet keeps its newest record only (nothing reads its past)
    assert [r["at"] - 1_780_000_000.0 for r in history.read("fleet")] == [901.5]
    assert history.latest("fleet")["at"] == 1_780_000_901.5


@pytest.mark.django_db(transaction=True)
def test_telemetry_command_runs_as_a_process_loop_and_resumes_history(pool, exporter, settings):
    _, endpoint = exporter
    set_endpoint_provider(lambda: [endpoint])
    history = SignalHistory()
    history.clear()
    try:
        for _ in range(2):  # two separate runs = a restart in between
            out = io.StringIO()
            call_command("telemetry", "--interval", "0.2", "--window", "5", "--polls", "2", stdout=out)
            assert "stopped after 2 polls" in out.getvalue()
        assert [r["seq"] for r in history.read(f"pool:{pool.pk}")][-4:] == [1, 3, 4, 5]
    finally:
        set_endpoint_provider(None)
        history.clear()


@pytest.fixture
def router_exporter():
    """A router's real metrics registry served on a loopback port: ``(RouterMetrics, RouterEndpoint)``."""
    with served_router_metrics() as exporter:
        yield exporter


@pytest.mark.django_db(transaction=True)
def test_router_decisions_reach_the_pool_they_name_scraped_once_for_every_cluster(
        make_cluster, make_pool, router_exporter, history):
    metrics, router = router_exporter
    decode = make_pool("decode")
    prefill = make_pool("prefill", role="prefill", cluster=make_cluster("dc-b"))
    clock = Clock(1_780_000_000.0)
    poller = TelemetryPoller(history=history, window_s=15, clock=clock, endpoints=lambda: [],
                             routers=lambda: [router], router_source=DirectScrapeSource(retention_s=60, clock=clock))
    local = metrics.decisions.labels(pool="decode", decision="local_prefill", track="stable")
    remote = metrics.decisions.labels(pool="decode", decision="remote_prefill", track="stable")
    local.inc(3)
    first = poller.poll_once()
    assert first[decode.pk]["signals"]["router_local_prefill_per_s"] is None  # one scrape: no rate yet
    local.inc(5)
    remote.inc(2)
    clock.t += 10.0
    records = poller.poll_once()
    # 3 -> 8 in 10 s: 0.5/s (Prometheus' extrapolation to the window start stops where the counter was 0).
    signals = records[decode.pk]["signals"]
    assert signals["router_local_prefill_per_s"] == pytest.approx(0.5, rel=1e-12)
    # 0 -> 2: a counter at 0 on its first sample is not extrapolated backwards, so 2 over the 15 s window
    # (recorded at 6 significant digits: poller.SIGNAL_DIGITS).
    assert signals["router_remote_prefill_per_s"] == 0.133333
    assert signals["router_local_prefill_fallback_per_s"] is None
    assert records[decode.pk]["tracks"]["stable"]["router_local_prefill_per_s"] == pytest.approx(0.5, rel=1e-12)
    assert records[prefill.pk]["signals"]["router_remote_prefill_per_s"] is None  # counted on the decode pool
    # What the dashboard and the gates read back is the same record.
    assert telemetry_signal(pool_id=decode.pk, name="router_local_prefill_per_s", history=history,
                            now_s=clock.t) == pytest.approx(0.5, rel=1e-12)
    # One scrape source per cluster, the router scraped once per poll into the shared store.
    assert len(poller.sources) == 2
    assert all(source.store.routers() == {} for source in poller.sources.values())
    assert list(poller.router_source.store.routers()) == [router.key]
    poller.close()


@pytest.mark.django_db
def test_telemetry_command_names_the_registered_routers(cluster):
    from apps.fleet.services import router_create

    router_create(name="r1", cluster=cluster, url="http://127.0.0.1:1")
    out = io.StringIO()
    call_command("telemetry", "--polls", "1", "--interval", "0.1", stdout=out)
    assert "routers: http://127.0.0.1:1/metrics" in out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_poller_records_the_pools_kv_transfers_by_direction_outcome_and_reason(pool, exporter, history):
    metrics, endpoint = exporter
    clock = Clock(float(int(time.time()) - 60))  # recent: history reads keep the last 15 minutes of real time
    poller = TelemetryPoller(  # the scrape source stamps its samples with the same fake clock
        history=history, window_s=10, clock=clock, endpoints=lambda: [endpoint], routers=lambda: [],
        source_factory=lambda choice, window_s, routers: DirectScrapeSource(retention_s=30, routers=routers,
                                                                           clock=clock))
    poller.poll_once()
    clock.t += 2.0
    idle = poller.poll_once()[pool.pk]
    # Workers that answer but never shipped KV: the request rate is a real 0 while the KV series do not exist
    # yet (the link shows 0 Gbit/s from the first, not "no data"), and the breakdown is empty.
    assert (idle["signals"]["request_rate_per_s"], idle["signals"]["kv_transfer_bytes_per_s"], idle["kv_transfers"]) == (
        0.0, None, {"transfers": [], "wire_bytes_per_s": {}})
    for _ in range(3):  # per poll: 3 transfers sent, 1 failing its checksum, 4000 wire bytes
        for outcome, reason in (("success", "none"), ("success", "none"), ("failure", "checksum")):
            metrics.kv_transfer.transfers.labels(**metrics.identity, direction="send", outcome=outcome,
                                                 reason=reason).inc()
        metrics.kv_transfer.wire_bytes.labels(**metrics.identity, direction="send").inc(4000)
        clock.t += 2.0
        record = poller.poll_once()[pool.pk]
    transfers = {(t["direction"], t["outcome"], t["reason"]): t["per_s"] for t in record["kv_transfers"]["transfers"]}
    assert list(transfers) == [("send", "failure", "checksum"), ("send", "success", "none")]
    failure, success = transfers.values()
    assert success == pytest.approx(2 * failure) and failure > 0
    assert record["kv_transfers"]["wire_bytes_per_s"]["send"] == pytest.approx(4000 * failure)
    assert history.latest(f"pool:{pool.pk}")["kv_transfers"] == record["kv_transfers"]
    poller.close()


@pytest.mark.django_db(transaction=True)
def test_the_poller_loop_keeps_one_polls_queries_in_the_debug_log(pool, history, settings):
    """The kind of the soak's slow growth (``apps.core.process_loop``): 5 polls, then 30 more, with ``DEBUG`` on
    (as ``make run`` sets it): the query log holds the last poll's queries only, not all 35 polls' (~3 KiB per
    poll before, up to Django's 9,000 queries). ``bench/leak_check.py`` looks for any other growth with
    tracemalloc over served worker metrics."""
    settings.DEBUG = True
    polls = itertools.count()
    start = time.time()
    poller = TelemetryPoller(history=history, window_s=10, interval_s=0.001, clock=lambda: start + next(polls),
                             endpoints=lambda: [], routers=lambda: [], slow_every=0)
    stop = threading.Event()
    try:
        assert poller.run(stop, max_polls=5) == 5
        with CaptureQueriesContext(connection) as one_poll:
            poller.poll_once()
        queries_of_one_poll = len(one_poll.captured_queries)
        assert poller.run(stop, max_polls=30) == 30
    finally:
        poller.close()
    assert len(connection.queries_log) == queries_of_one_poll > 0


def test_recorded_signals_keep_six_significant_digits_and_counts_and_times_exact():
    nested = {"ttft_p99_s": 0.14166666666666666, "wire": 1813353.3979619257, "tiny": 2.5e-07 / 3,
              "blocks": 421.0, "total": 12345678.0, "none": None, "nan": float("nan"), "inf": float("inf"),
              "count": 3, "name": "stable", "list": [{"per_s": 0.5170436412210931}, 7.0]}
    out = significant(nested)
    assert {k: v for k, v in out.items() if k != "nan"} == {
        "ttft_p99_s": 0.141667, "wire": 1813350.0, "tiny": 8.33333e-08, "blocks": 421.0, "total": 12345678.0,
        "none": None, "inf": float("inf"), "count": 3, "name": "stable", "list": [{"per_s": 0.517044}, 7.0]}
    assert out["nan"] != out["nan"]
    assert significant(-0.000123456789) == -0.000123457


def test_a_polls_record_stores_its_measured_values_at_six_digits_and_its_time_exact(pool, exporter, history):
    metrics, endpoint = exporter
    clock = Clock(float(int(time.time()) - 60) + 0.123456789)
    poller = TelemetryPoller(history=history, window_s=7, clock=clock, endpoints=lambda: [endpoint],
                             routers=lambda: [],
                             source_factory=lambda choice, window_s, routers: DirectScrapeSource(
                                 retention_s=30, routers=routers, clock=clock))
    poller.poll_once()
    metrics.kv_transfer.transfers.labels(**metrics.identity, direction="send", outcome="success", reason="none").inc()
    metrics.kv_transfer.wire_bytes.labels(**metrics.identity, direction="send").inc(1000)
    clock.t += 3.0
    record = poller.poll_once()[pool.pk]
    assert record["at"] == clock.t  # the time is not rounded
    # one transfer and 1000 bytes, new series, over the 7 s window: 1/7 and 1000/7 per second, at 6 significant
    # digits (full precision 0.14285714285714285 and 142.85714285714286)
    assert record["kv_transfers"] == {"transfers": [{"direction": "send", "outcome": "success", "reason": "none",
                                                     "per_s": 0.142857}], "wire_bytes_per_s": {"send": 142.857}}
    assert record["signals"]["kv_transfer_bytes_per_s"] == 142.857
    assert history.latest(f"pool:{pool.pk}") == record
    poller.close()
