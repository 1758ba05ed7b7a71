"""Test helper: a real Prometheus (Debian's ``prometheus`` package) on a free loopback port.

Started with a temporary config scraping the given endpoints and routers every second (the same
jobs ``endpoints.prometheus_scrape_config`` and ``prometheus_router_scrape_config`` build for
operators) and a temporary TSDB directory;
stopped and removed after. Install with ``apt-get install -y prometheus``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from apps.telemetry.endpoints import (
    ReplicaEndpoint,
    RouterEndpoint,
    prometheus_engine_scrape_configs,
    prometheus_router_scrape_config,
    prometheus_scrape_config,
)
from inference_worker.tests.support.worker import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def prometheus_available() -> bool:
    return Path(PROMETHEUS).is_file()


class PrometheusProcess:
    """``prometheus`` scraping ``endpoints`` (and ``routers``) every ``interval_s``; ``url`` once started.

    ``start`` returns once every target has been scraped successfully, and raises
    ``RuntimeError`` (with the log tail) if Prometheus exits or that takes over ``timeout_s``.
    """

    def __init__(self, endpoints: list[ReplicaEndpoint], *, interval_s: float = 1.0,
                 routers: list[RouterEndpoint] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="ferry-prometheus-"))
        config = {"global": {"scrape_interval": f"{round(interval_s * 1000)}ms",
                             "evaluation_interval": f"{round(interval_s * 1000)}ms"},
                  "scrape_configs": [prometheus_scrape_config(endpoints, interval_s=interval_s)]}
        config["scrape_configs"] += prometheus_engine_scrape_configs(endpoints, interval_s=interval_s)
        if routers:
            config["scrape_configs"].append(prometheus_router_scrape_config(routers, interval_s=interval_s))
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> PrometheusProcess:
        log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._all_targets_scraped():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout_s} s:\n{self.log_tail()}")

    def _all_targets_scraped(self) -> bool:
        """Ready and every target scraped once (Prometheus applies new targets a few seconds late)."""
        try:
            response = httpx.get(f"{self.url}/api/v1/targets", timeout=1)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        targets = response.json()["data"]["activeTargets"]
        return bool(targets) and all(t["health"] == "up" for t in targets)

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return (self.dir / "prometheus.log").read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrometheusProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
