"""Processes and threads of the local rollout end-to-end test (``test_local_rollouts_e2e.py``): a loop thread
(what beat schedules), the client load through the router, and the router process."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import httpx
from django.db import close_old_connections, connection
from prometheus_client.parser import text_string_to_metric_families

from inference_worker import http_headers
from inference_worker.tests.support.router import RouterProcess as BaseRouterProcess

logger = logging.getLogger(__name__)

MODEL = "gemma-3-270m"
SERVICE_TOKEN = "rollout-e2e-service-token"


class Loop(threading.Thread):
    """Call ``fn`` every ``interval_s`` until stopped (its own DB connection); errors are kept, not raised."""

    def __init__(self, name: str, fn, interval_s: float) -> None:  # noqa: ANN001 - a callable
        super().__init__(name=name, daemon=True)
        self.fn, self.interval_s = fn, interval_s
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                close_old_connections()
                try:
                    self.fn()
                except Exception as exc:  # noqa: BLE001 - kept for the assertion message
                    logger.exception("%s failed", self.name)
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                self.stop_event.wait(self.interval_s)
        finally:
            connection.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)


class Load(threading.Thread):
    """One completion every ``interval_s`` through the router; records ``(start, status, track, detail)``."""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        super().__init__(name="load", daemon=True)
        self.url, self.interval_s = url, interval_s
        self.stop_event = threading.Event()
        self.results: list[tuple[float, int, str, str]] = []

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "The ferry crossed the river at", "max_tokens": 2, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            while not self.stop_event.is_set():
                started = time.monotonic()
                try:
                    r = client.post(self.url + "/v1/completions", json=body)
                    detail = "" if r.status_code == 200 else r.text[:300]
                    self.results.append((started, r.status_code, r.headers.get(http_headers.TRACK, ""), detail))
                except httpx.HTTPError as exc:
                    self.results.append((started, 0, "", repr(exc)))
                self.stop_event.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def between(self, start: float, end: float = float("inf")) -> list[tuple[float, int, str, str]]:
        return [r for r in list(self.results) if start <= r[0] < end]

    def stop(self) -> None:
        self.stop_event.set()
        self.join(90)


class RouterProcess(BaseRouterProcess):
    """``python -m inference_worker router`` pulling the table from the control plane every 0.5 s."""

    def __init__(self, table_url: str, log_dir, *, wait: bool = True) -> None:  # noqa: ANN001 - a path
        super().__init__(table_url, "--service-token", SERVICE_TOKEN, "--table-interval", "0.5",
                         log_path=log_dir / "router.log", wait=wait)

    def counter(self, name: str, **labels: str) -> float:
        """The sum of the router's ``name`` samples whose labels include ``labels``."""
        total = 0.0
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def decisions(self) -> Counter:
        """``ferry_router_decisions_total`` summed by track."""
        out: Counter = Counter()
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for sample in family.samples:
                if sample.name == "ferry_router_decisions_total":
                    out[sample.labels["track"]] += int(sample.value)
        return out

