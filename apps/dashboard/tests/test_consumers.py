"""Websocket consumers over the real ASGI stack (session auth, origin check) and the real Redis channel
layer: anonymous refused; snapshot then live pool updates with increasing sequence numbers within 2 s of
a metric change; a client that misses a message resyncs; rollout streams forward their pools."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from channels.db import database_sync_to_async as db_thread  # closes the thread's connection after
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group
from django.db import connection, connections

from apps.dashboard.consumers import reads, rollout_group
from apps.rollouts.services import rollout_plan_create
from apps.telemetry.broadcast import pool_group, telemetry_broadcast
from apps.telemetry.history import SignalHistory
from apps.telemetry.poller import TelemetryPoller
from apps.telemetry.sources.scrape import DirectScrapeSource
from controlplane.asgi import application

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]
ORIGIN = (b"origin", b"http://127.0.0.1")


async def closing_db(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a worker thread that closes its database connections after, so the test
    database can be dropped (``database_sync_to_async`` may keep them open)."""

    def call():
        try:
            return fn(*args, **kwargs)
        finally:
            connections.close_all()

    return await asyncio.to_thread(call)


class FakeClock:
    """Unix seconds that move only when a test sets ``t``."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def communicator(path: str, session=None, origin=ORIGIN) -> WebsocketCommunicator:
    headers = [origin] if origin else []
    if session is not None:
        headers.append((b"cookie", f"sessionid={session.session_key}".encode()))
    return WebsocketCommunicator(application, path, headers=headers)


async def test_anonymous_client_is_refused(pool, telemetry_keys):
    for path in ("/ws/fleet/", f"/ws/pools/{pool.pk}/"):
        connected, _ = await communicator(path).connect()
        assert connected is False


async def test_user_without_a_role_is_refused(pool, telemetry_keys):
    def role_less_session():
        from django.contrib.auth.models import User
        from django.test import Client

        client = Client()
        client.force_login(User.objects.create_user("newcomer"))
        client.session_key = client.cookies["sessionid"].value
        return client

    session = await closing_db(role_less_session)
    for path in ("/ws/fleet/", f"/ws/pools/{pool.pk}/"):
        connected, _ = await communicator(path, session).connect()
        assert connected is False


async def test_foreign_origin_is_refused(pool, operator_session, telemetry_keys):
    ws = communicator(f"/ws/pools/{pool.pk}/", operator_session, origin=(b"origin", b"http://evil.example"))
    connected, _ = await ws.connect()
    assert connected is False


async def test_unknown_pool_is_closed_with_4404(operator_session, telemetry_keys):
    ws = communicator("/ws/pools/999999/", operator_session)
    connected, _ = await ws.connect()
    assert connected  # accepted before the lookup (daphne's handshake timeout), then closed
    assert await ws.receive_output(timeout=5) == {"type": "websocket.close", "code": 4404}


async def test_snapshot_then_live_updates_with_increasing_seq_within_two_seconds(
        pool, exporter, viewer_session, telemetry_keys):
    metrics, endpoint = exporter
    poller = await db_thread(TelemetryPoller)(window_s=10, interval_s=0.5, endpoints=lambda: [endpoint])
    stop = threading.Event()

    def run_poller() -> None:
        try:
            poller.run(stop)
        finally:
            connections.close_all()  # this thread's connection, so the test database can be dropped

    thread = threading.Thread(target=run_poller, daemon=True)
    thread.start()
    ws = communicator(f"/ws/pools/{pool.pk}/", viewer_session)
    try:
        connected, _ = await ws.connect()
        assert connected
        snapshot = await ws.receive_json_from(timeout=5)
        assert snapshot["type"] == "snapshot" and snapshot["stream"] == f"pool.{pool.pk}"
        assert snapshot["pool"]["id"] == pool.pk and snapshot["pool"]["replicas"] == 2
        last = snapshot["seq"]
        seen = []
        # A few polls at the old value, each numbered one more than the last.
        while len(seen) < 3:
            msg = await ws.receive_json_from(timeout=5)
            assert msg["type"] == "telemetry.signals" and msg["stream"] == f"pool.{pool.pk}"
            if msg["seq"] <= last:  # sent before the snapshot was read: already in it
                continue
            assert msg["seq"] == last + 1
            last = msg["seq"]
            seen.append(msg["signals"]["num_requests_waiting"])
        assert seen == [2.0, 2.0, 2.0]
        metrics.set_engine_state(num_waiting=7, num_running=1, kv_cache_usage=0.25, busy_ratio=0.5)
        changed_at = time.monotonic()
        while True:
            remaining = 2.0 - (time.monotonic() - changed_at)
            msg = await ws.receive_json_from(timeout=max(remaining, 0.001))  # TimeoutError after 2 s
            assert msg["seq"] == last + 1
            last = msg["seq"]
            if msg["signals"]["num_requests_waiting"] == 7.0:
                break
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        poller.close()
        await ws.disconnect()


async def test_client_that_misses_a_message_resyncs_to_the_latest_seq(pool, operator_session, telemetry_keys):
    history = SignalHistory()
    group = pool_group(pool.pk)
    record = {"pool_id": pool.pk, "at": time.time(), "window_s": 10.0, "source": "scrape",
              "signals": {"num_requests_waiting": 1.0}, "tracks": {}}

    def publish(waiting: float) -> dict:
        message = telemetry_broadcast(group, "telemetry.signals",
                                      {**record, "signals": {"num_requests_waiting": waiting}}, history=history)
        history.append(f"pool:{pool.pk}", time.time(), message)
        return message

    await asyncio.to_thread(publish, 1.0)
    ws = communicator(f"/ws/pools/{pool.pk}/", operator_session)
    connected, _ = await ws.connect()
    assert connected
    snapshot = await ws.receive_json_from(timeout=5)
    assert snapshot["seq"] == 1
    assert [r["signals"] for r in snapshot["records"]] == [{"num_requests_waiting": 1.0}]

    await asyncio.to_thread(history.next_seq, group)  # seq 2 is taken and never delivered: a lost message
    await asyncio.to_thread(publish, 3.0)
    msg = await ws.receive_json_from(timeout=5)
    assert msg["seq"] == 3  # the client expected 2: a gap
    await ws.send_json_to({"type": "resync", "stream": f"pool.{pool.pk}"})
    again = await ws.receive_json_from(timeout=5)
    assert again["type"] == "snapshot" and again["seq"] == 3
    assert [r["signals"]["num_requests_waiting"] for r in again["records"]] == [1.0, 3.0]
    await asyncio.to_thread(publish, 4.0)
    msg = await ws.receive_json_from(timeout=5)
    assert (msg["seq"], msg["signals"]["num_requests_waiting"]) == (4, 4.0)
    await ws.send_json_to({"type": "subscribe"})
    assert (await ws.receive_json_from(timeout=5))["type"] == "error"
    await ws.disconnect()


async def test_fleet_stream_snapshot_and_alerts(pool, viewer_session, telemetry_keys):
    ws = communicator("/ws/fleet/", viewer_session)
    connected, _ = await ws.connect()
    assert connected
    snapshot = await ws.receive_json_from(timeout=5)
    assert (snapshot["type"], snapshot["stream"], snapshot["seq"], snapshot["record"]) == ("snapshot", "fleet", 0, None)
    (dc,) = snapshot["overview"]["datacenters"]
    assert dc["name"] == "dc-a" and dc["clusters"][0]["pools"][0]["name"] == "decode"
    history = SignalHistory()
    alert = {"id": 1, "rule": "ttft-p99-high", "pool_id": pool.pk, "state": "firing", "severity": "warning"}
    await asyncio.to_thread(telemetry_broadcast, "telemetry.fleet", "telemetry.alert", {"alert": alert}, history=history)
    msg = await ws.receive_json_from(timeout=5)
    assert (msg["type"], msg["stream"], msg["seq"], msg["alert"]["rule"]) == ("telemetry.alert", "fleet", 1, "ttft-p99-high")
    await ws.disconnect()


async def test_rollout_stream_forwards_its_pools_and_rollout_state(make_pool, make_model_version, operator_session,
                                                                   telemetry_keys):
    prefill = await db_thread(make_pool)("prefill", role="prefill")
    decode = await db_thread(make_pool)("decode", role="decode")
    target = await db_thread(make_model_version)("v2")
    plan = await db_thread(rollout_plan_create)(name="to-v2", pools=[prefill, decode], target_model_version=target,
                                   strategy="canary", steps=[{"set_weight": 10}])
    ws = communicator(f"/ws/rollouts/{plan.pk}/", operator_session)
    connected, _ = await ws.connect()
    assert connected
    streams = {}
    for _ in range(3):
        msg = await ws.receive_json_from(timeout=5)
        streams[msg["stream"]] = msg
    assert set(streams) == {f"pool.{prefill.pk}", f"pool.{decode.pk}", f"rollout.{plan.pk}"}
    assert streams[f"rollout.{plan.pk}"]["rollout"]["steps"] == [{"set_weight": 10}]
    await get_channel_layer().group_send(rollout_group(plan.pk), {"type": "rollout.state", "state": "progressing"})
    msg = await ws.receive_json_from(timeout=5)
    assert (msg["type"], msg["stream"], msg["state"]) == ("rollout.state", f"rollout.{plan.pk}", "progressing")
    await ws.disconnect()


async def test_pool_snapshot_and_updates_carry_the_routers_local_and_remote_prefill_rates(
        pool, exporter, router_exporter, viewer_session, telemetry_keys):
    """The pool page's router chart reads ``router_local_prefill_per_s`` / ``router_remote_prefill_per_s``
    from the same records as every chart: in the snapshot and in each live update."""
    _, endpoint = exporter
    router_metrics, router = router_exporter
    clock = FakeClock(time.time() - 10.0)  # the history keeps the records the snapshot reads (last 15 min)
    poller = await closing_db(TelemetryPoller, window_s=15, clock=clock, endpoints=lambda: [endpoint],
                              routers=lambda: [router], router_source=DirectScrapeSource(retention_s=60, clock=clock))
    local = router_metrics.decisions.labels(pool=pool.name, decision="local_prefill", track="stable")
    remote = router_metrics.decisions.labels(pool=pool.name, decision="remote_prefill", track="stable")
    local.inc(3)
    remote.inc(6)
    ws = communicator(f"/ws/pools/{pool.pk}/", viewer_session)
    try:
        await closing_db(poller.poll_once)
        local.inc(5)  # 3 -> 8 in 10 s: 0.5/s
        remote.inc(6)  # 6 -> 12 in 10 s: 0.6/s
        clock.t += 10.0
        await closing_db(poller.poll_once)
        connected, _ = await ws.connect()
        assert connected
        snapshot = await ws.receive_json_from(timeout=5)
        first, second = snapshot["records"]
        assert (first["signals"]["router_local_prefill_per_s"], first["signals"]["router_remote_prefill_per_s"]) == (
            None, None)  # one scrape: no rate yet (the chart shows "no data", not 0)
        assert second["signals"]["router_local_prefill_per_s"] == pytest.approx(0.5, rel=1e-12)
        assert second["signals"]["router_remote_prefill_per_s"] == pytest.approx(0.6, rel=1e-12)
        remote.inc(10)  # the next 10 s: 12 -> 22
        clock.t += 10.0
        await closing_db(poller.poll_once)
        update = await ws.receive_json_from(timeout=5)
        assert (update["type"], update["seq"]) == ("telemetry.signals", snapshot["seq"] + 1)
        # The window (5, 20] s after the first scrape holds the scrapes at 10 and 20 s: local 8 -> 8, remote
        # 12 -> 22 extrapolated by 5 s to the window start (the counter was far from 0): 0/s and 15 / 15 s.
        assert update["signals"]["router_local_prefill_per_s"] == 0.0
        assert update["signals"]["router_remote_prefill_per_s"] == pytest.approx(1.0, rel=1e-12)
    finally:
        await ws.disconnect()
        await asyncio.to_thread(poller.close)


async def test_a_dropped_final_message_is_noticed_by_asking_for_the_streams_last_seq(
        pool, operator_session, telemetry_keys):
    """Regression (issue 20): a gap showed only when a later message arrived, so a lost last message went unseen.
    The client asks for each stream's last sequence number every few seconds (static/dashboard/js/common.js)."""
    history = SignalHistory()
    group, stream = pool_group(pool.pk), f"pool.{pool.pk}"
    ws = communicator(f"/ws/pools/{pool.pk}/", operator_session)
    connected, _ = await ws.connect()
    assert connected
    assert (await ws.receive_json_from(timeout=5))["seq"] == 0
    await ws.send_json_to({"type": "seq", "stream": stream})
    assert await ws.receive_json_from(timeout=5) == {"type": "seq", "stream": stream, "seq": 0}
    await asyncio.to_thread(history.next_seq, group)  # seq 1 is taken and never delivered, and nothing follows
    await ws.send_json_to({"type": "seq", "stream": stream})
    assert await ws.receive_json_from(timeout=5) == {"type": "seq", "stream": stream, "seq": 1}
    await ws.disconnect()


async def test_a_rollout_snapshot_carries_its_groups_last_seq_and_saving_the_plan_sends_rollout_state(
        make_pool, make_model_version, operator_session, telemetry_keys):
    from apps.rollouts.services import rollout_pause, rollout_start

    decode = await db_thread(make_pool)("decode", role="colocated")
    target = await db_thread(make_model_version)("v2")
    plan = await db_thread(rollout_plan_create)(name="to-v2", pools=[decode], target_model_version=target,
                                                strategy="canary", steps=[{"set_weight": 10}, {"pause": {}}])
    first = await asyncio.to_thread(SignalHistory().current_seq, rollout_group(plan.pk))
    assert first == 1  # the plan's creation was saved and sent (nobody listened)
    ws = communicator(f"/ws/rollouts/{plan.pk}/", operator_session)
    connected, _ = await ws.connect()
    assert connected
    snapshots = {m["stream"]: m for m in [await ws.receive_json_from(timeout=5) for _ in range(2)]}
    assert snapshots[f"rollout.{plan.pk}"]["seq"] == first
    await closing_db(rollout_start, plan=plan)
    await closing_db(rollout_pause, plan=plan)
    got = [await ws.receive_json_from(timeout=5) for _ in range(2)]
    assert [(m["type"], m["stream"], m["seq"], m["state"]) for m in got] == [
        ("rollout.state", f"rollout.{plan.pk}", first + 1, "progressing"),
        ("rollout.state", f"rollout.{plan.pk}", first + 2, "paused")]
    await ws.disconnect()


async def test_each_consumer_read_keeps_only_its_own_queries_in_the_debug_log(settings):
    """A consumer's reads run on pool threads that live as long as the server: with ``DEBUG`` on, each read's
    thread holds that read's queries only (``apps.core.process_loop``), not every earlier read's."""
    settings.DEBUG = True

    def count_then_log_length() -> int:
        Group.objects.count()
        return len(connection.queries_log)

    assert [await reads(count_then_log_length)() for _ in range(20)] == [1] * 20
