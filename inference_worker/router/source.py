"""Where the routing table comes from, and the replicas' queue depths (background refreshers).

:class:`TableSource` reads the table from a file (re-read when its mtime or size changes) or pulls it
from the control plane (``GET /api/v1/routing-table/`` with ``Authorization: Bearer <service token>``
and ``If-None-Match: <last ETag>``; 304 keeps the current table) every ``interval_s`` (default 1 s).
A pull or parse failure keeps the last good table and is counted. :class:`LinkLoadSource` lays the links'
measured utilisation over it (a small document polled beside the table; its docstring says why). The version applied is exported as
``ferry_router_routing_table_version`` so a rollout can wait until traffic really moved.

Failures are logged per streak, not per attempt: at ``make run`` the router starts before the web answers, and a
line a second until then buried the launcher's output. Before the first table the router waits quietly (one INFO
line, then a WARNING only if no table came after :data:`STILL_FAILING_LOG_S`); a streak after a table had been
applied logs one WARNING when it starts; either streak logs again every :data:`STILL_FAILING_LOG_S` while it lasts
and once (INFO) when it ends, with the number of failed attempts.

:class:`QueueDepthScraper` reads each replica's ``/metrics`` and records the sums of
``ferry_num_requests_waiting`` and ``ferry_num_requests_running`` and the largest
``ferry_kv_cache_usage_ratio`` (scoring's load signals); a vLLM or SGLang pool's page is read through
:func:`inference_worker.engine_kinds.translate_samples` (``vllm:num_requests_waiting``, ``sglang:num_queue_reqs``...).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urljoin

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inference_worker.engine_kinds import FERRY, translate_samples
from inference_worker.router.decisions import LoadTracker
from inference_worker.router.metrics import RouterMetrics
from inference_worker.router.table import RoutingTable, RoutingTableError

log = logging.getLogger(__name__)

STILL_FAILING_LOG_S = 60.0
"""Seconds between the lines of a streak of failed refreshes (module docstring)."""


class TableSource:
    """Keeps ``self.table`` current from ``location`` (a path or an ``http(s)://`` URL)."""

    def __init__(self, location: str, *, client: httpx.AsyncClient, metrics: RouterMetrics,
                 service_token: str | None = None, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.location, self.client, self.metrics = location, client, metrics
        self.service_token, self.interval_s = service_token, interval_s
        self.is_url = location.startswith(("http://", "https://"))
        self.table: RoutingTable | None = None
        """The table in use: the last one pulled (:attr:`base`) with the measured link load laid over it."""
        self.base: RoutingTable | None = None
        self.link_utilisation: dict[tuple[str, str], float] | None = None
        """Measured utilisation per (source, target) datacenters (:class:`LinkLoadSource`); None: none current."""
        self.etag: str | None = None
        self._file_stamp: tuple[int, int] | None = None
        self.clock = clock
        self.failures = 0
        """Failed refreshes in the current streak (0: the last refresh worked)."""
        self._failing_since = self._last_logged = 0.0

    async def refresh(self) -> bool:
        """Fetch once; return True if a new table was applied. Failures are counted (``table_errors``) and logged
        per streak (module docstring)."""
        try:
            data = await (self._pull() if self.is_url else self._read_file())
            table = None if data is None else RoutingTable.from_dict(data)
        except (OSError, httpx.HTTPError, ValueError, RoutingTableError) as exc:
            self.metrics.table_errors.inc()
            self._failed(exc)
            return False
        if table is None:  # 304: the control plane answers and we hold its table; a file: unchanged since read
            if self.is_url:
                self._recovered()
            return False
        changed = self.base is None or table != self.base
        self.base = table
        self.table = table.with_link_utilisation(self.link_utilisation)
        self.metrics.table_version.set(table.version)
        self._recovered()
        return changed

    def _failed(self, exc: Exception) -> None:
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._failing_since = self._last_logged = now
            if self.table is None:
                log.info("waiting for the routing table from %s (%s); retrying every %g s", self.location, exc,
                         self.interval_s)
            else:
                log.warning("routing table refresh from %s failed: %s; keeping table v%d, retrying every %g s",
                            self.location, exc, self.table.version, self.interval_s)
        elif now - self._last_logged >= STILL_FAILING_LOG_S:
            self._last_logged = now
            what = "no routing table yet" if self.table is None else f"keeping table v{self.table.version}"
            log.warning("routing table from %s still failing after %d attempts over %.0f s (%s): %s",
                        self.location, self.failures, now - self._failing_since, what, exc)

    def _recovered(self) -> None:
        if self.failures:
            log.info("routing table from %s: v%d after %d failed attempt(s) over %.0f s", self.location,
                     self.table.version if self.table else -1, self.failures, self.clock() - self._failing_since)
            self.failures = 0

    async def _read_file(self) -> dict | None:
        path = Path(self.location)
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._file_stamp:
            return None
        data = json.loads(path.read_text())
        self._file_stamp = stamp
        return data

    async def _pull(self) -> dict | None:
        headers = {"Accept": "application/json"}
        if self.service_token:
            headers["Authorization"] = f"Bearer {self.service_token}"
        if self.etag and self.table is not None:
            headers["If-None-Match"] = self.etag
        response = await self.client.get(self.location, headers=headers, timeout=5.0)
        if response.status_code == 304:
            return None
        response.raise_for_status()
        data = response.json()
        self.etag = response.headers.get("ETag")
        return data

    async def run(self) -> None:
        """Refresh every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()


    def apply_link_load(self, utilisation: dict[tuple[str, str], float] | None) -> None:
        """Lay the measured link utilisation over the table (None: back to the table's own values) and export it
        as ``ferry_router_link_utilisation_ratio``."""
        self.link_utilisation = utilisation
        if self.base is not None:
            self.table = self.base.with_link_utilisation(utilisation)
            for link in self.table.links:
                self.metrics.link_utilisation.labels(source=link.source, target=link.target).set(link.utilisation)


def link_load_url(table_url: str) -> str:
    """The link-load document's URL beside a control-plane routing-table URL
    (``.../api/v1/routing-table/`` -> ``.../api/v1/link-load/``)."""
    return urljoin(table_url if table_url.endswith("/") else table_url + "/", "../link-load/")


def parse_link_load(data: object) -> dict[tuple[str, str], float]:
    """``{"links": [{"source", "target", "utilisation"}, ...]}`` -> utilisation per (source, target).

    Raises:
        ValueError: not that shape (a link that is not an object with the three keys, a source or target that is
            not a string), or a utilisation that is not a finite number >= 0 (a bool, a string, an int too large
            for a float, NaN); the message names the link's index. Only ValueError: the poller catches it.
    """
    if not isinstance(data, dict) or not isinstance(data.get("links"), list):
        raise ValueError("the link-load document must be an object with a 'links' list")
    out = {}
    for i, entry in enumerate(data["links"]):
        if not isinstance(entry, dict) or not {"source", "target", "utilisation"} <= entry.keys():
            raise ValueError(f"link {i}: expected an object with source, target and utilisation, got {entry!r:.100}")
        source, target, value = entry["source"], entry["target"], entry["utilisation"]
        if not (isinstance(source, str) and isinstance(target, str)):
            raise ValueError(f"link {i}: source and target must be cluster names, got {source!r:.50}, {target!r:.50}")
        share = math.nan
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                share = float(value)
            except OverflowError:
                pass
        if not (math.isfinite(share) and share >= 0):
            raise ValueError(f"link {i}: utilisation must be a finite number >= 0, got {value!r:.50}")
        out[(source, target)] = share
    return out


class LinkLoadSource:
    """Polls the control plane's link-load document (``GET /api/v1/link-load/``, telemetry's measurement,
    :mod:`apps.telemetry.link_load`) every ``interval_s`` and lays it over ``source``'s table.

    Why a separate document and not the table: the utilisation changes every second; in the versioned table it
    would make every router download the whole table (pools, replicas, models, keys) every second instead of a
    304 (``bench/table_fanout.py`` measures that path). This document is a few dozen bytes per link, served from
    Redis before Django like the table, with an ETag (a 304 when unchanged).

    A measurement older than ``stale_s`` (a failed pull, a 404 because telemetry has not published one, a stopped
    poller whose document expired) is dropped: the router then routes on the table's own link values (0 when
    the control plane's table carries none) rather than on an old load.
    """

    def __init__(self, source: TableSource, *, client: httpx.AsyncClient, url: str, service_token: str | None = None,
                 interval_s: float = 1.0, stale_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.source, self.client, self.url = source, client, url
        self.service_token, self.interval_s, self.stale_s, self.clock = service_token, interval_s, stale_s, clock
        self.etag: str | None = None
        self.fetched_at: float | None = None
        """When the current measurement was last confirmed (a 200 or a 304), on ``clock``."""

    async def refresh(self) -> None:
        """Pull once; apply a new document, keep the current one on a 304, drop it once stale."""
        headers = {"Accept": "application/json"}
        if self.service_token:
            headers["Authorization"] = f"Bearer {self.service_token}"
        if self.etag and self.source.link_utilisation is not None:
            headers["If-None-Match"] = self.etag
        try:
            response = await self.client.get(self.url, headers=headers, timeout=2.0)
            if response.status_code == 304:
                self.fetched_at = self.clock()
                return
            response.raise_for_status()
            utilisation = parse_link_load(response.json())
        except (httpx.HTTPError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
            log.debug("link load from %s not refreshed: %s", self.url, exc)
            if self.fetched_at is not None and self.clock() - self.fetched_at > self.stale_s:
                self.fetched_at, self.etag = None, None
                self.source.apply_link_load(None)
            return
        self.etag, self.fetched_at = response.headers.get("ETag"), self.clock()
        self.source.apply_link_load(utilisation)

    async def run(self) -> None:
        """Refresh every ``interval_s`` until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)


SCRAPED = ("ferry_num_requests_waiting", "ferry_num_requests_running", "ferry_kv_cache_usage_ratio")


class QueueDepthScraper:
    """Scrapes the load signals (:data:`SCRAPED`) from every replica in the current table."""

    def __init__(self, source: TableSource, loads: LoadTracker, *, client: httpx.AsyncClient,
                 interval_s: float = 1.0):
        self.source, self.loads, self.client, self.interval_s = source, loads, client, interval_s

    async def scrape(self) -> None:
        """One pass over all replicas (concurrently); unreachable replicas lose their queue depth."""
        table = self.source.table
        if table is None:
            return
        results = await asyncio.gather(*(self._signals(r.url, r.engine) for r in table.replicas))
        for replica, signals in zip(table.replicas, results, strict=True):
            if signals is None:
                self.loads.forget(replica.name)
            else:
                waiting, running, usage = signals
                self.loads.queue_depth[replica.name] = waiting
                self.loads.running[replica.name] = running
                self.loads.kv_usage[replica.name] = usage

    async def _signals(self, url: str, engine: str = FERRY) -> tuple[float, float, float] | None:
        """Summed waiting and running requests and the largest KV usage of one replica's ``/metrics`` page, read in
        Ferry's names (an engine's own series translated by :mod:`inference_worker.engine_kinds`); None if the page
        cannot be fetched or parsed."""
        try:
            response = await self.client.get(url + "/metrics", timeout=2.0)
            response.raise_for_status()
            values: dict[str, list[float]] = {name: [] for name in SCRAPED}
            samples = translate_samples(engine, ((sample.name, sample.labels, sample.value)
                                                 for family in text_string_to_metric_families(response.text)
                                                 for sample in family.samples))
            for name, _labels, value in samples:
                if name in values:
                    values[name].append(value)
            waiting, running, usage = values.values()
            return sum(waiting), sum(running), max(usage, default=0.0)
        except (httpx.HTTPError, ValueError):
            return None

    async def run(self) -> None:
        """Scrape every ``interval_s`` until cancelled."""
        while True:
            await self.scrape()
            await asyncio.sleep(self.interval_s)
