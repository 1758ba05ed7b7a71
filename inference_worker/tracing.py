"""Request tracing of routers and workers (OpenTelemetry), and the slow-request timeline behind
``GET /debug/slow-requests``.

Two outputs from one record per request, a :class:`Timeline` of named phases (wall-clock start and end,
nanoseconds since the Unix epoch, plus attributes such as token counts or bytes):

- **OpenTelemetry spans**, only when tracing is on (:func:`configure` with a ratio > 0: ``--trace-ratio`` or
  ``FERRY_TRACE_RATIO``). The request's span is a live SERVER span whose parent comes from the caller's W3C
  ``traceparent`` header (:func:`extract`); its phases become child spans with their recorded start and end
  (:func:`emit_phases`); outgoing calls carry the request span's ``traceparent`` (:func:`inject`). Spans go
  to an OTLP/HTTP collector (the SDK's ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``..._TRACES_ENDPOINT``, default
  ``http://localhost:4318``) through a batch processor, off the request path. Sampling is parent-based with a
  trace-id ratio at the root (the router), so a trace is kept or dropped whole.
  With tracing off (the default) no SDK tracer provider is installed: :data:`tracer` is the API's proxy to
  its no-op tracer, and the request paths skip span work altogether (:func:`enabled` is False).
- **The slow-request ring** (:class:`SlowRequests`), always on: the last ``capacity`` finished requests'
  timelines, of which the endpoint returns the slowest. It holds request ids, phase names, timings, token
  and byte counts, never prompt or output text, so it is served open like ``/metrics``; the telemetry
  poller collects it for the pool page's waterfall (the data plane never writes to the control plane).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

RATIO_ENV = "FERRY_TRACE_RATIO"
"""Environment variable with the default sampling ratio (0 to 1; unset or 0: tracing off)."""
SLOW_REQUESTS_PATH = "/debug/slow-requests"
"""Route of the slow-request timeline on routers and workers."""
DEFAULT_SLOW_LIMIT = 20
MAX_REQUEST_ID_CHARS = 128
"""A client's ``X-Request-Id`` is kept to this many characters (it is held in the slow-request ring, forwarded to
workers and stored by the telemetry poller; a 16 KB header must not be, 512 times over)."""
MAX_SLOW_LIMIT = 200

tracer = trace.get_tracer("ferry")
"""Ferry's tracer: the API's proxy, no-op until :func:`configure` installs an SDK provider."""
_propagator = TraceContextTextMapPropagator()
_state: dict[str, Any] = {"enabled": False, "phases_to": None}


def request_id(headers: Mapping[str, str]) -> str:
    """The request's id: its ``X-Request-Id`` cut to :data:`MAX_REQUEST_ID_CHARS` characters, or a new random hex
    id when there is none or it is not printable ASCII (the router forwards the id in a header, which httpx encodes
    as ASCII: ``X-Request-Id: é`` was a 500). The router forwards this id, so a worker's record joins the router's."""
    given = (headers.get("x-request-id") or "")[:MAX_REQUEST_ID_CHARS]
    return given if given.isascii() and given.isprintable() and given.strip() else uuid.uuid4().hex


def enabled() -> bool:
    """Whether this process traces (an SDK provider was installed with a ratio > 0)."""
    return _state["enabled"]


def ratio_from_env(default: float = 0.0) -> float:
    """``FERRY_TRACE_RATIO`` as a float, or ``default`` when unset.

    Raises:
        ValueError: not a number in [0, 1].
    """
    raw = os.environ.get(RATIO_ENV, "").strip()
    return check_ratio(float(raw)) if raw else default


def check_ratio(ratio: float) -> float:
    """``ratio`` if it is in [0, 1]; ValueError otherwise (a sampling ratio is a probability)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"the trace sampling ratio must be in [0, 1], got {ratio}")
    return ratio


def configure(service_name: str, ratio: float, *, exporter: Any = None) -> bool:
    """Turn tracing on for this process when ``ratio`` > 0; returns whether it is on.

    Installs an SDK ``TracerProvider`` (resource ``service.name``; sampler ``ParentBased(TraceIdRatioBased(ratio))``)
    with a ``BatchSpanProcessor`` around ``exporter``. Default exporter: :class:`ProcessSpanExporter`, which hands
    each batch to a child process running the SDK's ``OTLPSpanExporter`` (HTTP/protobuf, configured by the standard
    ``OTEL_EXPORTER_OTLP_*`` variables), so the protobuf encoding and the HTTP POST of the spans (about 17 us of
    CPU per span, and a thread that takes the GIL for milliseconds at each export) stay off the serving process;
    with it, a request's phases are also made into spans there (:meth:`ProcessSpanExporter.add_phases`: about
    25 us of SDK work per span), not in the serving process (:func:`emit_phases`, with any other exporter).
    With ``ratio`` 0 nothing is imported from the SDK, nothing is installed and no process is started.

    Raises:
        ValueError: ``ratio`` outside [0, 1].
    """
    check_ratio(ratio)
    if ratio == 0.0:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        exporter = ProcessSpanExporter()
    _state["phases_to"] = exporter if isinstance(exporter, ProcessSpanExporter) else None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _state["enabled"] = True
    return True


def shutdown() -> None:
    """Flush and stop the SDK provider, if one is installed (called at process exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def _context_record(context: trace.SpanContext) -> tuple:
    state = context.trace_state
    return (context.trace_id, context.span_id, context.trace_flags, tuple(state.items()) if state else (),
            context.is_remote)


def _context_from(record: tuple) -> trace.SpanContext:
    trace_id, span_id, flags, state, remote = record
    return trace.SpanContext(trace_id, span_id, remote, trace.TraceFlags(flags), trace.TraceState(list(state)))


def span_records(spans: Any, phases: Any = ()) -> tuple[list, list, list, list]:
    """Finished SDK spans (``ReadableSpan``) as plain, picklable tuples: ``(resources, scopes, records,
    phase_records)``, each resource ``(attributes, schema_url)`` and scope ``(name, version, schema_url,
    attributes)`` once per batch, a record naming them by index (:func:`spans_from_records` inverts it).
    ``phases``: ``(parent, [(name, start_ns, end_ns, attributes), ...])`` pairs, ``parent`` an SDK span, each
    becoming ``(resource, scope, parent_context, phases)``. Dropped-attribute counts are not carried (Ferry's
    spans stay far under the SDK's limit of 128 attributes)."""
    resources: dict[int, int] = {}
    scopes: dict[int, int] = {}
    resource_rows: list = []
    scope_rows: list = []

    def indices(span: Any) -> tuple[int, int]:
        resource, scope = span.resource, span.instrumentation_scope
        if id(resource) not in resources:
            resources[id(resource)] = len(resource_rows)
            resource_rows.append((dict(resource.attributes), resource.schema_url))
        if id(scope) not in scopes:
            scopes[id(scope)] = len(scope_rows)
            scope_rows.append(None if scope is None else (scope.name, scope.version, scope.schema_url,
                                                          dict(scope.attributes or {})))
        return resources[id(resource)], scopes[id(scope)]

    records = []
    for span in spans:
        parent, attributes, events, links, status = span.parent, span.attributes, span.events, span.links, span.status
        records.append((span.name, _context_record(span.context), parent and _context_record(parent),
                        attributes.copy() if attributes else {},
                        [(e.name, dict(e.attributes or {}), e.timestamp) for e in events] if events else (),
                        [(_context_record(link.context), dict(link.attributes or {})) for link in links]
                        if links else (),
                        span.kind.value, status.status_code.value, status.description,
                        span.start_time, span.end_time, *indices(span)))
    phase_records = [(*indices(parent), _context_record(parent.get_span_context()), rows) for parent, rows in phases]
    return resource_rows, scope_rows, records, phase_records


def spans_from_records(resource_rows: list, scope_rows: list, records: list, phase_records: list = ()) -> list:
    """The SDK ``ReadableSpan`` objects of :func:`span_records`' tuples (for the SDK's exporters): the records'
    spans, then each phase as a child span of its parent made by an SDK ``Tracer`` of the parent's resource and
    scope (new span ids; the parent's trace id; the phase's start, end and attributes), as :func:`emit_phases`
    makes them in the serving process."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    resources = [Resource(attributes, schema_url) for attributes, schema_url in resource_rows]
    scopes = [None if row is None else InstrumentationScope(row[0], row[1], row[2], row[3]) for row in scope_rows]
    spans = []
    for (name, context, parent, attributes, events, links, kind, code, description, start, end, resource,
         scope) in records:
        spans.append(ReadableSpan(
            name, _context_from(context), parent and _context_from(parent), resources[resource], attributes,
            [Event(e_name, e_attributes, timestamp) for e_name, e_attributes, timestamp in events],
            [trace.Link(_context_from(l_context), l_attributes) for l_context, l_attributes in links],
            trace.SpanKind(kind), status=trace.Status(trace.StatusCode(code), description), start_time=start,
            end_time=end, instrumentation_scope=scopes[scope]))
    for resource, scope, parent, rows in phase_records:
        tracer, finished = _phase_tracer(resource_rows[resource], scope_rows[scope])
        ctx = trace.set_span_in_context(trace.NonRecordingSpan(_context_from(parent)))
        for name, start, end, attributes in rows:
            tracer.start_span(name, context=ctx, start_time=start, attributes=attributes).end(end_time=end)
        spans += finished
        finished.clear()
    return spans


_phase_tracers: dict[str, tuple[Any, list]] = {}


def _phase_tracer(resource_row: tuple, scope_row: tuple | None) -> tuple[Any, list]:
    """An SDK tracer of this resource and scope whose finished spans are appended to the returned list (made once
    per resource and scope and kept: an exporter child serves one process, of one resource and one scope)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    key = repr((resource_row, scope_row))
    if key not in _phase_tracers:
        finished: list = []

        class Collect(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                finished.extend(spans)
                return SpanExportResult.SUCCESS

        provider = TracerProvider(resource=Resource(*resource_row))
        provider.add_span_processor(SimpleSpanProcessor(Collect()))
        name, version, schema_url, attributes = scope_row or ("", None, None, None)
        _phase_tracers[key] = provider.get_tracer(name, version, schema_url, attributes), finished
    return _phase_tracers[key]


class ProcessSpanExporter:
    """An SDK span exporter that runs the real one (``OTLPSpanExporter()``) in a child process, where it also makes
    the spans of the phases queued with :meth:`add_phases`.

    ``export(spans)`` (called on the ``BatchSpanProcessor``'s thread) turns the batch into plain tuples
    (:func:`span_records`, a few microseconds per span) and writes it, pickled, to the child's stdin; the child
    (:func:`export_child`, niced by 10: span export yields the CPU to serving) rebuilds the SDK's ``ReadableSpan``
    objects and exports them. A full pipe blocks the processor's thread (without the GIL), and the processor's
    bounded queue then drops spans, as it does for a slow collector. The child inherits the environment, so the
    ``OTEL_EXPORTER_OTLP_*`` variables configure it; it exits when its stdin closes (also when this process dies).
    A forked copy of this process starts a child of its own at its first export.

    ``command``: the child's command line (default: this interpreter running :func:`export_child`).
    """

    def __init__(self, command: list[str] | None = None):
        import sys

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = f"import sys; sys.path.insert(0, {root!r}); from inference_worker.tracing import export_child; " \
               "export_child()"
        self._command = command or [sys.executable, "-c", code]
        self._lock = threading.Lock()
        self._phases: collections.deque = collections.deque(maxlen=self.MAX_PENDING_PHASES)
        self._start()

    def _start(self) -> None:
        import subprocess

        self._pid = os.getpid()
        self._process = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    MAX_PENDING_PHASES = 8192
    """Requests whose phases wait for the next export at most (beyond: the oldest are dropped, as the batch
    processor drops spans when its queue is full)."""

    def add_phases(self, parent: Any, phases: list[tuple[str, int, int, dict]]) -> None:
        """Queue ``phases`` (``(name, start_ns, end_ns, attributes)``) to become child spans of the SDK span
        ``parent`` in the child process; they go with the next :meth:`export`, so call this before ending
        ``parent`` (O(1), no I/O: safe on the event loop)."""
        self._phases.append((parent, phases))

    def _send(self, message: Any) -> bool:
        import pickle

        with self._lock:
            try:
                pickle.dump(message, self._process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self._process.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):  # the child is gone or the pipe closed at shutdown
                return False

    def _own_process(self) -> None:
        """In a forked copy of this process (e.g. a Celery prefork child), start its own child process and drop
        what was pending in the parent: interleaved writes of two processes on one pipe would corrupt it."""
        with self._lock:
            if os.getpid() != self._pid:
                try:
                    self._process.stdin.close()  # this copy's descriptor only: the parent's child keeps running
                except OSError:
                    pass
                self._phases.clear()
                self._start()

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._own_process()
        phases = []
        while self._phases:
            phases.append(self._phases.popleft())
        ok = self._send(("spans", *span_records(spans, phases)))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until the child has exported everything sent so far (True), at most ``timeout_millis``."""
        import select

        self._own_process()
        if not self._send(("flush",)):
            return False
        ready, _, _ = select.select([self._process.stdout], [], [], timeout_millis / 1000)
        return bool(ready) and self._process.stdout.read(1) == b"1"

    def shutdown(self) -> None:
        """Close the child's stdin; it exports what it holds and exits (killed after 30 s)."""
        import subprocess

        with self._lock:
            try:
                self._process.stdin.close()
            except OSError:
                pass
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def export_child() -> None:
    """The child process of :class:`ProcessSpanExporter`: reads pickled messages from stdin until it closes,
    exports each ``("spans", resources, scopes, records, phases)`` batch (:func:`spans_from_records`) with
    ``OTLPSpanExporter()``, and answers each
    ``("flush",)`` with one byte ``1`` on stdout once everything before it is exported."""
    import pickle
    import sys

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    try:
        os.nice(10)
    except OSError:
        pass
    exporter = OTLPSpanExporter()
    stream = sys.stdin.buffer
    while True:
        try:
            message = pickle.load(stream)
        except EOFError:
            break
        if message[0] == "spans":
            exporter.export(spans_from_records(*message[1:]))
        elif message[0] == "flush":
            sys.stdout.buffer.write(b"1")
            sys.stdout.buffer.flush()
    exporter.shutdown()


def extract(headers: Mapping[str, str]) -> otel_context.Context:
    """The OpenTelemetry context of an incoming request's ``traceparent`` / ``tracestate`` headers."""
    return _propagator.extract(headers)


def inject(headers: dict[str, str], span: trace.Span) -> None:
    """Add ``span``'s ``traceparent`` (and ``tracestate``) to outgoing ``headers`` whenever its context is valid,
    sampled or not: an unsampled request carries trace flags ``00`` (W3C Trace Context), so a callee's
    ``ParentBased`` sampler records nothing for it either, whatever that callee's own ratio (otherwise a router
    sampling 10% in front of workers at 100% would leave 90% of requests as worker-only traces). Nothing when
    tracing is off in this process (the API's invalid span)."""
    if span.get_span_context().is_valid:
        _propagator.inject(headers, context=trace.set_span_in_context(span))


@dataclass
class Phase:
    """One phase of a request: ``name``, wall-clock ``start_ns`` / ``end_ns`` (ns since the Unix epoch);
    ``span``: also exported as a span (False: the slow-request timeline only, e.g. another process's phase)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    span: bool = True


@dataclass
class Timeline:
    """The phases of one request in one process (router, decode or prefill worker).

    Attributes:
        role: ``router``, ``decode``, ``prefill`` or ``colocated`` (a worker that prefills and decodes).
        request_id: the router's ``X-Request-Id`` (routers and decode workers) or the hand-off's request id.
        start_ns: when the process received the request (ns since the Unix epoch).
        attributes: request-level figures (replica, decision, token counts); never prompt text.
    """

    role: str
    request_id: str
    start_ns: int = field(default_factory=time.time_ns)
    phases: list[Phase] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)
    end_ns: int | None = None

    def add(self, name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
        """Record a phase (``end_ns`` below ``start_ns`` is clamped to it)."""
        self.phases.append(Phase(name, start_ns, max(start_ns, end_ns), attributes))

    def finish(self, end_ns: int | None = None) -> None:
        self.end_ns = time.time_ns() if end_ns is None else end_ns

    @property
    def duration_ms(self) -> float:
        return ((self.end_ns or time.time_ns()) - self.start_ns) / 1e6

    def as_record(self) -> dict:
        """JSON record: ``start_s`` (Unix seconds), ``duration_ms``, ``phases`` (``start_ms`` from the request's
        start, ``duration_ms``, ``attributes``), ``attributes``."""
        return {"role": self.role, "request_id": self.request_id, "start_s": self.start_ns / 1e9,
                "duration_ms": round(self.duration_ms, 3), "attributes": self.attributes,
                "phases": [{"name": p.name, "start_ms": round((p.start_ns - self.start_ns) / 1e6, 3),
                            "duration_ms": round((p.end_ns - p.start_ns) / 1e6, 3), "attributes": p.attributes}
                           for p in self.phases]}


def emit_phases(parent: trace.Span, timeline: Timeline) -> None:
    """Each phase of ``timeline`` as a child span of ``parent`` with its recorded start and end (nothing when
    ``parent`` is not recording)."""
    if not parent.is_recording():
        return
    ctx = trace.set_span_in_context(parent)
    for phase in timeline.phases:
        if not phase.span:
            continue
        span = tracer.start_span(phase.name, context=ctx, start_time=phase.start_ns, attributes=phase.attributes)
        span.end(end_time=phase.end_ns)


class RequestSpan:
    """The live span of one request in this process, or a no-op stand-in when tracing is off.

    ``RequestSpan(name, headers)`` starts a SERVER span whose parent is the caller's ``traceparent``;
    :meth:`end` adds the timeline's attributes and phases and ends it. When :func:`enabled` is False nothing
    is created (``span`` is the API's invalid span, not recording).
    """

    __slots__ = ("span",)

    def __init__(self, name: str, headers: Mapping[str, str] | None, start_ns: int | None = None):
        if not _state["enabled"]:
            self.span = trace.INVALID_SPAN
            return
        self.span = tracer.start_span(name, context=extract(headers or {}), kind=trace.SpanKind.SERVER,
                                      start_time=start_ns)

    def inject(self, headers: dict[str, str]) -> None:
        inject(headers, self.span)

    def end_soon(self, timeline: Timeline, *, error: str | None = None) -> None:
        """:meth:`end` on the event loop's next turn (after the answer's bytes are handed to the server), so the
        span work is off the request's latency; at once without a running loop. Nothing when not recording."""
        if not self.span.is_recording():
            return
        try:
            asyncio.get_running_loop().call_soon(lambda: self.end(timeline, error=error))
        except RuntimeError:
            self.end(timeline, error=error)

    def end(self, timeline: Timeline, *, error: str | None = None) -> None:
        span = self.span
        if not span.is_recording():
            return
        span.set_attributes({f"ferry.{k}": v for k, v in timeline.attributes.items()
                             if isinstance(v, str | bool | int | float)})
        span.set_attribute("ferry.request_id", timeline.request_id)
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        if (to := _state["phases_to"]) is not None:
            to.add_phases(span, [(p.name, p.start_ns, p.end_ns, dict(p.attributes)) for p in timeline.phases
                                  if p.span])
        else:
            emit_phases(span, timeline)
        span.end(end_time=timeline.end_ns)


class SlowRequests:
    """The last ``capacity`` finished requests' timelines; :meth:`slowest` returns the slowest of them.

    Appending is O(1) and thread-safe (a deque with ``maxlen``); :meth:`slowest` sorts a copy
    (O(capacity log capacity), on the endpoint's request only).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = 512):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._recent: collections.deque[Timeline] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def record(self, timeline: Timeline) -> None:
        if timeline.end_ns is None:
            timeline.finish()
        with self._lock:
            self._recent.append(timeline)

    def __iter__(self) -> Iterator[Timeline]:
        with self._lock:
            return iter(list(self._recent))

    def slowest(self, limit: int = DEFAULT_SLOW_LIMIT) -> list[dict]:
        """The ``limit`` slowest recent requests as :meth:`Timeline.as_record` dicts, slowest first."""
        ranked = sorted(self, key=lambda t: t.end_ns - t.start_ns, reverse=True)
        return [t.as_record() for t in ranked[:limit]]


def slow_limit(raw: str | None) -> int:
    """The ``limit`` query parameter of ``/debug/slow-requests`` (default 20, 1..200).

    Raises:
        ValueError: not an integer in that range (the endpoints answer 400 with this message).
    """
    if raw is None or raw == "":
        return DEFAULT_SLOW_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        raise ValueError(f"limit must be an integer from 1 to {MAX_SLOW_LIMIT}, got {raw!r}") from None
    if not 1 <= limit <= MAX_SLOW_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_SLOW_LIMIT}, got {limit}")
    return limit
