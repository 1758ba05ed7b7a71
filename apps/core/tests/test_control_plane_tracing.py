"""Control-plane tracing (``controlplane.tracing``): with ``FERRY_TRACE_RATIO`` > 0 a Django request is a SERVER span
whose parent is the caller's W3C ``traceparent``, and a Celery publish made under it is its child and carries the
context in the task message's headers (the task run's span on the worker continues from there). Run in a child
process: a tracer provider is installed once per process, and the other tests run with tracing off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from inference_worker.tests.support.worker import REPO_ROOT

TRACE_ID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
SCRIPT = f"""
import json, os
os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from controlplane.tracing import instrument_web
exporter = InMemorySpanExporter()
assert instrument_web(exporter)
import django
django.setup()
from django.test import Client
from controlplane.celery import app
app.conf.broker_url = "memory://"
Client().get("/no-such-page/", HTTP_HOST="127.0.0.1", HTTP_TRACEPARENT="00-{TRACE_ID}-{PARENT}-01")
with trace.get_tracer("test").start_as_current_span("action.request"):
    app.send_task("operations.reconcile", queue="trace-test")
trace.get_tracer_provider().force_flush()
print(json.dumps([{{"name": s.name, "trace_id": format(s.context.trace_id, "032x"), "kind": s.kind.name,
                   "span_id": format(s.context.span_id, "016x"),
                   "parent": format(s.parent.span_id, "016x") if s.parent else ""}}
                  for s in exporter.get_finished_spans()]))
"""


def test_django_and_celery_instrumentations_continue_the_callers_trace():
    env = {**os.environ, "FERRY_TRACE_RATIO": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    spans = json.loads(done.stdout.strip().splitlines()[-1])
    server = [s for s in spans if s["kind"] == "SERVER"]
    assert len(server) == 1 and (server[0]["trace_id"], server[0]["parent"]) == (TRACE_ID, PARENT)
    action = next(s for s in spans if s["name"] == "action.request")
    publish = next(s for s in spans if s["kind"] == "PRODUCER")
    assert publish["name"] == "apply_async/operations.reconcile"
    assert (publish["trace_id"], publish["parent"]) == (action["trace_id"], action["span_id"])
