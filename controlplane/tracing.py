"""OpenTelemetry for the control plane: an Action's path web -> Celery -> backend as one trace.

Off unless ``FERRY_TRACE_RATIO`` is above 0 (the same variable and sampler as the routers and workers:
:func:`inference_worker.tracing.configure`; spans to ``OTEL_EXPORTER_OTLP_ENDPOINT`` over OTLP/HTTP). When on,
:func:`instrument_web` (``controlplane.asgi``, before Django's application is built) installs the official Django
instrumentation (a SERVER span per request, ``traceparent`` honoured) and the Celery one (the publish span of
``transaction.on_commit``'s enqueue carries the context in the task's headers); :func:`instrument_celery` (each
Celery worker process, ``worker_process_init``) installs the Celery one there (a span per task run, a child of the
request's publish span). Off, nothing is imported from the SDK or the instrumentations.
"""

from __future__ import annotations

from inference_worker import tracing


def instrument_web(exporter=None) -> bool:
    """Trace Django requests and Celery publishes in this (web) process; returns whether tracing is on.
    ``exporter``: the span exporter (default OTLP/HTTP; tests pass an in-memory one).

    Raises:
        ValueError: ``FERRY_TRACE_RATIO`` is not a number in [0, 1].
    """
    if not tracing.configure("ferry-web", tracing.ratio_from_env(), exporter=exporter):
        return False
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor

    DjangoInstrumentor().instrument()
    CeleryInstrumentor().instrument()
    return True


def instrument_celery(exporter=None) -> bool:
    """Trace task runs in this Celery worker process; returns whether tracing is on (see :func:`instrument_web`)."""
    if not tracing.configure("ferry-celery", tracing.ratio_from_env(), exporter=exporter):
        return False
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().instrument()
    return True
