"""Request tracing: the slow-request ring, tracing off by default, and one real router -> decode -> prefill
completion traced end to end.

The real-process test collects the spans the three processes export over OTLP/HTTP (their SDK's batch
processor and ``OTLPSpanExporter``) with a small in-test OTLP receiver that decodes the protobuf
``ExportTraceServiceRequest``: the processes are separate, so an in-process in-memory exporter cannot see
their spans; the receiver keeps them in memory in the same way.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry import trace

from inference_worker import http_headers, tracing
from inference_worker.tests.support.router import RouterProcess
from inference_worker.tests.support.worker import (
    WorkerProcess,
    free_port,
    gemma_tokenizer_dir,
    start_together,
)
from inference_worker.tokenization import load_tokenizer
from inference_worker.tracing import SlowRequests, Timeline


def timeline(request_id: str, start_ns: int, duration_ms: float) -> Timeline:
    t = Timeline("router", request_id, start_ns=start_ns)
    t.add("router.route", start_ns, start_ns + 1_000_000, decision="remote_prefill")
    t.finish(start_ns + int(duration_ms * 1e6))
    return t


def test_slow_requests_keeps_the_last_capacity_and_returns_the_slowest_first():
    ring = SlowRequests(capacity=3)
    for i, ms in enumerate((50.0, 10.0, 30.0, 20.0)):  # the 50 ms one falls out of the ring
        ring.record(timeline(f"r{i}", 1_000_000_000 * (i + 1), ms))
    assert [r["request_id"] for r in ring.slowest(2)] == ["r2", "r3"]
    first = ring.slowest(1)[0]
    assert first == {"role": "router", "request_id": "r2", "start_s": 3.0, "duration_ms": 30.0, "attributes": {},
                     "phases": [{"name": "router.route", "start_ms": 0.0, "duration_ms": 1.0,
                                 "attributes": {"decision": "remote_prefill"}}]}


@pytest.mark.parametrize("raw, expected", [(None, 20), ("", 20), ("1", 1), ("200", 200)])
def test_slow_limit_accepts_1_to_200(raw, expected):
    assert tracing.slow_limit(raw) == expected


@pytest.mark.parametrize("raw", ["0", "201", "ten", "-3"])
def test_slow_limit_refuses_others(raw):
    with pytest.raises(ValueError, match="limit must be an integer from 1 to 200"):
        tracing.slow_limit(raw)


def test_ratio_zero_installs_no_sdk_provider_and_spans_are_no_ops():
    assert tracing.configure("test", 0.0) is False
    assert not tracing.enabled()
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
    span = tracing.RequestSpan("router.request", {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"})
    assert span.span is trace.INVALID_SPAN
    headers: dict[str, str] = {}
    span.inject(headers)
    assert headers == {}
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        tracing.configure("test", 1.5)


def finished_spans() -> list:
    """SDK spans of every shape the exporter must carry: a remote parent with a trace state, a child span with
    attributes of each type, an event, a link and an error status, under two resources and two scopes."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    out = []
    for service in ("ferry-router", "ferry-worker-decode"):
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        remote = trace.SpanContext(0x1F, 0x2E, True, trace.TraceFlags(1), trace.TraceState([("ven", "x1")]))
        parent_ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        tracer = provider.get_tracer("ferry", "1.2", schema_url="https://opentelemetry.io/schemas/1.21.0")
        root = tracer.start_span(f"{service}.request", context=parent_ctx, kind=trace.SpanKind.SERVER,
                                 start_time=1_000, attributes={"ferry.tokens": 7, "ferry.ok": True,
                                                               "ferry.share": 0.5, "ferry.names": ("a", "b")})
        root.add_event("retry", {"attempt": 2}, timestamp=1_500)
        root.set_status(trace.Status(trace.StatusCode.ERROR, "status 502"))
        child = provider.get_tracer("other").start_span(
            "kv.send", context=trace.set_span_in_context(root), start_time=1_100,
            links=[trace.Link(remote, {"link.kind": "follows"})], attributes={"bytes_wire": 4096})
        child.end(end_time=1_900)
        root.end(end_time=2_000)
        out += memory.get_finished_spans()
    return out


def test_span_records_round_trip_to_the_same_otlp_bytes():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    spans = finished_spans()
    rebuilt = tracing.spans_from_records(*tracing.span_records(spans))
    assert encode_spans(rebuilt).SerializeToString() == encode_spans(spans).SerializeToString()
    assert [s.name for s in rebuilt] == ["kv.send", "ferry-router.request", "kv.send", "ferry-worker-decode.request"]


def test_phases_become_child_spans_like_emit_phases_makes_them(monkeypatch):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "ferry-worker-prefill"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    timeline = Timeline("prefill", "r1", start_ns=1_000)
    timeline.add("prefill.queue", 1_000, 1_400, depth=2)
    timeline.add("kv.send", 1_400, 1_300, bytes_raw=8192, bytes_wire=4096)  # clamped: ends at its start
    timeline.phases.append(tracing.Phase("decode", 1_500, 1_600, span=False))  # another process's phase
    timeline.finish(2_000)
    monkeypatch.setattr(tracing, "tracer", provider.get_tracer("ferry"))  # emit_phases' tracer, of this provider
    root = tracing.tracer.start_span("prefill.request", start_time=1_000)
    tracing.emit_phases(root, timeline)
    root.end(end_time=2_000)
    in_process = memory.get_finished_spans()[:2]
    rows = [(p.name, p.start_ns, p.end_ns, p.attributes) for p in timeline.phases if p.span]
    rebuilt = tracing.spans_from_records(*tracing.span_records([], [(root, rows)]))

    def without_span_ids(span):  # the span ids are random in both
        return encode_spans([span]).resource_spans[0].scope_spans[0].spans[0]

    assert len(rebuilt) == 2
    for made, expected in zip(rebuilt, in_process, strict=True):
        got, want = without_span_ids(made), without_span_ids(expected)
        assert len(got.span_id) == 8 and got.span_id != want.span_id
        got.span_id = want.span_id
        assert got == want
        assert made.resource.attributes == expected.resource.attributes
        assert made.instrumentation_scope == expected.instrumentation_scope
    assert [(s.name, s.start_time, s.end_time, s.parent.span_id) for s in rebuilt] == [
        ("prefill.queue", 1_000, 1_400, root.context.span_id), ("kv.send", 1_400, 1_400, root.context.span_id)]


def test_the_process_exporter_posts_the_spans_from_its_child_process(collector, monkeypatch):
    url, received = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url + "/v1/traces")
    exporter = tracing.ProcessSpanExporter()
    spans = finished_spans()
    try:
        before = len(received)
        exporter.add_phases(spans[1], [("router.route", 1_050, 1_090, {"decision": "remote_prefill"})])
        assert exporter.export(spans).name == "SUCCESS"
        assert exporter.force_flush(30_000) is True
        got = received[before:]
    finally:
        exporter.shutdown()
    assert exporter._process.returncode == 0
    root = f"{0x2E:016x}"
    assert [(s["service"], s["scope"], s["name"], s["parent"], s["start"], s["end"]) for s in got] == [
        ("ferry-router", "other", "kv.send", got[1]["span_id"], 1_100, 1_900),
        ("ferry-router", "ferry", "ferry-router.request", root, 1_000, 2_000),
        ("ferry-router", "ferry", "router.route", got[1]["span_id"], 1_050, 1_090),
        ("ferry-worker-decode", "other", "kv.send", got[4]["span_id"], 1_100, 1_900),
        ("ferry-worker-decode", "ferry", "ferry-worker-decode.request", root, 1_000, 2_000)]
    assert {s["trace_id"] for s in got} == {f"{0x1F:032x}"}
    assert got[1]["attrs"]["ferry.tokens"] == 7 and got[0]["attrs"] == {"bytes_wire": 4096}
    assert got[2]["attrs"] == {"decision": "remote_prefill"}


def test_a_forked_process_exports_through_a_child_of_its_own(collector, monkeypatch):
    url, received = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url + "/v1/traces")
    exporter = tracing.ProcessSpanExporter()
    spans = finished_spans()
    before = len(received)
    try:
        pid = os.fork()
        if pid == 0:  # the forked copy: its spans must arrive whole, through another exporter process
            code = 1
            try:
                inherited = exporter._process.pid
                ok = exporter.export(spans[:2]).name == "SUCCESS" and exporter.force_flush(30_000)
                code = 0 if ok and exporter._process.pid != inherited else 1
                exporter.shutdown()
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert exporter.export(spans[2:]).name == "SUCCESS"
        assert exporter.force_flush(30_000) is True
    finally:
        exporter.shutdown()
    assert sorted((s["service"], s["name"]) for s in received[before:]) == [
        ("ferry-router", "ferry-router.request"), ("ferry-router", "kv.send"),
        ("ferry-worker-decode", "ferry-worker-decode.request"), ("ferry-worker-decode", "kv.send")]


# ---- one completion through the router with remote prefill, real processes ---------------------------------

class _Receiver(BaseHTTPRequestHandler):
    spans: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        for resource in request.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_spans:
                for s in scope.spans:
                    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}
                    self.spans.append({"service": service, "scope": scope.scope.name, "name": s.name, "trace_id": s.trace_id.hex(),
                                       "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                       "start": s.start_time_unix_nano, "end": s.end_time_unix_nano, "attrs": attrs})
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def collector():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", _Receiver.spans
    server.shutdown()


SECRET = "ferry-test-link-secret-0123456789"
COMMON = ("--kv-link-secret", SECRET, "--kv-cache-memory", "256MiB", "--max-num-seqs", "4", "--model-version", "v1")


@pytest.fixture(scope="module")
def traced_stack(collector, tmp_path_factory):
    url, spans = collector
    env = {tracing.RATIO_ENV: "1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url + "/v1/traces",
           "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "30"}
    prefill = WorkerProcess("--role", "prefill", *COMMON, env=env)
    decode = WorkerProcess("--role", "decode", "--kv-timeout", "120", *COMMON, env=env)
    table = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
             "pools": [{"name": "decode-dc1", "role": "decode", "datacenter": "dc1",
                        "replicas": [{"name": "d0", "url": decode.base_url, "track": "stable"}]},
                       {"name": "prefill-dc2", "role": "prefill", "datacenter": "dc2",
                        "replicas": [{"name": "p0", "url": prefill.base_url, "track": "stable"}]}],
             "length_routing": {"threshold_tokens": 100}}
    path = tmp_path_factory.mktemp("trace") / "table.json"
    path.write_text(json.dumps(table))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the router inherits the test's environment
    try:  # launched first: it needs only its table, and starts while the workers load
        router = RouterProcess(path, "--tokenizer", str(gemma_tokenizer_dir()), "--scrape-interval", "0", wait=False)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        start_together(prefill, decode)
        router.wait_ready()
    except BaseException:
        router.stop()
        raise
    try:
        yield router, decode, prefill, spans
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of ``[start, end)`` intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


CRITICAL = ("router.admit", "router.route", "worker.parse", "prefill.queue", "prefill.compute", "prefill.encode",
            "kv.send", "decode.queue", "decode")


@pytest.mark.slow
def test_a_remote_prefill_completion_through_the_router_is_one_trace(traced_stack):
    router, decode, prefill, spans = traced_stack
    text = " ".join(f"Crate {i} of the ferry holds {3 * i + 1} apples for the island market." for i in range(9))
    assert len(load_tokenizer(gemma_tokenizer_dir()).encode(text).ids) > 100  # over the threshold: remote prefill
    body = {"model": "gemma-3-270m", "prompt": text, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(timeout=600) as client:
        # warm-up: every hop's connection open (router -> decode -> prefill) and first-call costs paid
        warm = client.post(router.url + "/v1/completions", json={**body, "prompt": "Warm " + text})
        assert warm.status_code == 200, warm.text
        started = time.perf_counter()
        response = client.post(router.url + "/v1/completions", json=body, headers={"x-request-id": "trace-1"})
        latency_ns = (time.perf_counter() - started) * 1e9
    assert response.status_code == 200, response.text
    assert response.headers[http_headers.DECISION] == "remote_prefill"

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        roots = [s for s in spans if s["name"] == "router.request" and s["attrs"].get("ferry.request_id") == "trace-1"]
        trace_spans = [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"] and s["scope"] == "ferry"]
        if roots and {"kv.send", "decode", "router.relay"} <= {s["name"] for s in trace_spans}:
            break
        time.sleep(0.2)
    assert len(roots) == 1
    root = roots[0]
    by_name = {s["name"]: s for s in trace_spans}
    assert sorted(by_name) == sorted(["router.request", "router.admit", "router.route", "router.upstream",
                                      "router.relay", "worker.request", "worker.parse", "kv.handoff", "decode.queue",
                                      "decode", "prefill.request", "prefill.queue", "prefill.compute",
                                      "prefill.encode", "kv.send"])
    assert len(trace_spans) == len(by_name)  # one of each: one trace, one hand-off
    assert root["parent"] == ""
    parents = {"router.admit": "router.request", "router.route": "router.request", "router.upstream": "router.request",
               "router.relay": "router.request", "worker.request": "router.request",
               "worker.parse": "worker.request", "kv.handoff": "worker.request", "decode.queue": "worker.request",
               "decode": "worker.request", "prefill.request": "worker.request", "prefill.queue": "prefill.request",
               "prefill.compute": "prefill.request", "prefill.encode": "prefill.request", "kv.send": "prefill.request"}
    for child, parent in parents.items():
        assert by_name[child]["parent"] == by_name[parent]["span_id"], child
    assert {s["service"] for s in trace_spans} == {"ferry-router", "ferry-worker-decode", "ferry-worker-prefill"}

    root_ns = root["end"] - root["start"]
    assert abs(root_ns - latency_ns) <= max(0.10 * latency_ns, 5e6), (root_ns, latency_ns)
    covered = union_ns([(max(by_name[n]["start"], root["start"]), min(by_name[n]["end"], root["end"]))
                        for n in CRITICAL])
    print(f"client {latency_ns / 1e6:.1f} ms, root {root_ns / 1e6:.1f} ms, critical path covers {covered / root_ns:.1%}")
    for s in sorted(trace_spans, key=lambda s: s["start"]):
        print(f"  {s['name']:<18} {(s['start'] - root['start']) / 1e6:9.1f} ms +{(s['end'] - s['start']) / 1e6:9.1f} ms")
    assert covered >= 0.90 * root_ns

    route, send = by_name["router.route"]["attrs"], by_name["kv.send"]["attrs"]
    assert (route["decision"], route["decode_replica"], route["prefill_replica"]) == ("remote_prefill", "d0", "p0")
    assert by_name["decode"]["attrs"]["num_output_tokens"] == 4
    assert send["raw_bytes"] > 0 and send["wire_bytes"] >= send["raw_bytes"] and send["link_cap_wait_ms"] == 0.0
    assert root["attrs"]["ferry.decode_replica"] == "d0" and root["attrs"]["ferry.cached_tokens"] == 0

    # the same request in the decode worker's slow-request timeline, with the prefill worker's phases placed in it
    record = next(r for r in httpx.get(decode.base_url + "/debug/slow-requests").json()["requests"]
                  if r["request_id"] == "trace-1")
    assert [p["name"] for p in record["phases"]] == ["worker.parse", "kv.handoff", "kv.transfer", "prefill.compute",
                                                     "prefill.queue", "decode.queue", "decode"]
    assert httpx.get(router.url + "/debug/slow-requests?limit=0").status_code == 400


@pytest.mark.slow
def test_an_unsampled_request_is_traced_by_no_process_even_where_the_ratio_is_one(traced_stack):
    """The caller's sampling decision holds across hops: a ``traceparent`` with flags ``00`` reaches the router,
    which passes it on (not nothing), so neither worker starts a trace of its own for that request."""
    router, decode, prefill, spans = traced_stack
    text = " ".join(f"Lane {i} of the pier waits for the {i + 2} o'clock ferry to the north harbour." for i in range(9))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    body = {"model": "gemma-3-270m", "prompt": text, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    headers = {"x-request-id": "unsampled-1", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-00"}
    with httpx.Client(timeout=600) as client:
        response = client.post(router.url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers[http_headers.DECISION] == "remote_prefill"
        # a sampled request after it: once its spans are in, the unsampled one's would be too (same exporters)
        marker = client.post(router.url + "/v1/completions", json={**body, "prompt": "Then " + text},
                             headers={"x-request-id": "sampled-after"})
        assert marker.status_code == 200, marker.text
    deadline = time.monotonic() + 20
    seen: set = set()
    while time.monotonic() < deadline:
        roots = [s["trace_id"] for s in spans if s["name"] == "router.request"
                 and s["attrs"].get("ferry.request_id") == "sampled-after"]
        seen = {(s["service"], s["name"]) for s in spans if s["trace_id"] in roots}
        if {("ferry-router", "router.request"), ("ferry-worker-decode", "worker.request"),
                ("ferry-worker-prefill", "prefill.request")} <= seen:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the sampled marker request's spans never all arrived: {sorted(seen)}")
    assert [s for s in spans if s["trace_id"] == trace_id] == []
    assert [(s["service"], s["name"]) for s in spans if s["attrs"].get("ferry.request_id") == "unsampled-1"] == []
