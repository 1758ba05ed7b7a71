"""Test helpers shared by the telemetry and dashboard tests (imported by their fixtures, not by the product)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import start_http_server

from apps.telemetry.endpoints import RouterEndpoint
from inference_worker.router.metrics import RouterMetrics


@contextmanager
def served_router_metrics() -> Iterator[tuple[RouterMetrics, RouterEndpoint]]:
    """A router's real metrics registry (``inference_worker.router.metrics``) served over HTTP on a free
    loopback port; yields the registry and the endpoint telemetry scrapes; stops the server on exit."""
    metrics = RouterMetrics()
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        yield metrics, RouterEndpoint(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
