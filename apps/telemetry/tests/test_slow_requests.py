"""The slow-request collector: a decode worker's record joined with the router's record of the same request
(phases on the router's clock), prefill workers' own records left out, unreachable endpoints skipped."""

from __future__ import annotations

import httpx

from apps.telemetry.endpoints import ReplicaEndpoint, RouterEndpoint
from apps.telemetry.slow_requests import collect_slow_requests, join_records
from inference_worker.tracing import SlowRequests, Timeline

MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000  # ns


def ring_records(*timelines: Timeline) -> dict:
    ring = SlowRequests()
    for t in timelines:
        ring.record(t)
    return {"requests": ring.slowest(20)}


def router_timeline() -> Timeline:
    t = Timeline("router", "req-1", start_ns=T0)
    t.add("router.admit", T0, T0 + 1 * MS)
    t.add("router.route", T0 + 1 * MS, T0 + 3 * MS, decision="remote_prefill")
    t.add("router.upstream", T0 + 3 * MS, T0 + 90 * MS)
    t.finish(T0 + 100 * MS)
    return t


def decode_timeline() -> Timeline:
    start = T0 + 4 * MS  # the decode worker received it 4 ms after the router
    t = Timeline("decode", "req-1", start_ns=start)
    t.add("worker.parse", start, start + 2 * MS)
    t.add("kv.handoff", start + 2 * MS, start + 60 * MS)
    t.add("kv.transfer", start + 50 * MS, start + 60 * MS)
    t.add("prefill.compute", start + 10 * MS, start + 50 * MS)
    t.add("prefill.queue", start + 5 * MS, start + 10 * MS)
    t.add("decode.queue", start + 60 * MS, start + 61 * MS)
    t.add("decode", start + 61 * MS, start + 95 * MS)
    t.finish(start + 95 * MS)
    return t


def test_join_places_the_workers_phases_on_the_routers_clock_and_drops_containers():
    router, decode = router_timeline().as_record(), decode_timeline().as_record()
    row = join_records(decode, router, replica="d0")
    assert (row["request_id"], row["replica"], row["duration_ms"]) == ("req-1", "d0", 100.0)
    assert [(p["name"], p["lane"], p["start_ms"], p["duration_ms"]) for p in row["phases"]] == [
        ("router.admit", "router", 0.0, 1.0), ("router.route", "router", 1.0, 2.0),
        ("worker.parse", "decode", 4.0, 2.0), ("kv.transfer", "transfer", 54.0, 10.0),
        ("prefill.compute", "prefill", 14.0, 40.0), ("prefill.queue", "prefill", 9.0, 5.0),
        ("decode.queue", "decode", 64.0, 1.0), ("decode", "decode", 65.0, 34.0)]


def test_collect_reads_routers_and_replicas_keeps_decode_rows_and_skips_failures():
    prefill_record = Timeline("prefill", "req-1", start_ns=T0 + 9 * MS)
    prefill_record.finish(T0 + 64 * MS)
    pages = {"http://router:9100/debug/slow-requests": ring_records(router_timeline()),
             "http://d0:8000/debug/slow-requests": ring_records(decode_timeline()),
             "http://p0:8000/debug/slow-requests": ring_records(prefill_record)}

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.params["limit"] == "20"
        page = pages.get(str(request.url.copy_with(query=None)))
        return httpx.Response(200, json=page) if page else httpx.Response(404)

    endpoints = [ReplicaEndpoint("7", "stable", "d0", "http://d0:8000"),
                 ReplicaEndpoint("8", "stable", "p0", "http://p0:8000"),
                 ReplicaEndpoint("7", "stable", "d1", "http://d1:8000")]  # answers 404: skipped
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        rows = collect_slow_requests(endpoints, [RouterEndpoint("http://router:9100/metrics")], client=client)
    assert list(rows) == ["7"]
    assert [(r["request_id"], r["replica"], r["duration_ms"], len(r["phases"])) for r in rows["7"]] == [
        ("req-1", "d0", 100.0, 8)]


def test_an_endpoint_answering_something_else_is_skipped_and_never_stops_the_collection():
    """Before: a list body raised AttributeError, a record without ``request_id`` KeyError, out of the poller's
    loop (which catches database and Redis errors only), so one odd endpoint stopped telemetry altogether."""
    good = ring_records(decode_timeline())
    pages = {"http://r1:9100/debug/slow-requests": [1, 2],
             "http://r2:9100/debug/slow-requests": {"requests": "abc"},
             "http://d0:8000/debug/slow-requests": {"requests": [{"id": "x"}, None, *good["requests"],
                                                                 {**good["requests"][0], "phases": [7]}]},
             "http://d1:8000/debug/slow-requests": {"requests": [{"request_id": 5, "start_s": 1, "duration_ms": 1}]}}

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=pages[str(request.url.copy_with(query=None))])

    endpoints = [ReplicaEndpoint("7", "stable", "d0", "http://d0:8000"),
                 ReplicaEndpoint("7", "stable", "d1", "http://d1:8000")]
    routers = [RouterEndpoint("http://r1:9100/metrics"), RouterEndpoint("http://r2:9100/metrics")]
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        rows = collect_slow_requests(endpoints, routers, client=client)
    assert [(r["request_id"], r["replica"]) for r in rows["7"]] == [("req-1", "d0")]
