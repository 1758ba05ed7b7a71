"""When is ``make run`` ready: the web answers, the model workers are ready and the router has a table.

:func:`readiness_missing` checks once and lists what is still missing (empty list: ready):

1. ``GET <web>/healthz`` answers 200 (database and Redis reachable);
2. the published routing table (``GET <web>/api/v1/routing-table/`` with the service token) lists, for each
   expected pool, at least its desired number of ready replicas (the table only carries replicas
   that are alive, ready and have an endpoint);
3. ``GET <router>/ready`` answers 200 and the router applied that table's version or a later one.

:func:`wait_until_ready` polls until ready, a stop event or a timeout, reporting progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class ReadinessTarget:
    """What to check: the web and router base URLs, the service token, desired replicas per pool name."""

    web_url: str
    router_url: str
    service_token: str
    pools: Mapping[str, int] = field(default_factory=dict)


def _get_json(client: httpx.Client, url: str, **kwargs) -> tuple[int, dict | None]:
    try:
        response = client.get(url, **kwargs)
    except httpx.HTTPError:
        return 0, None
    try:
        body = response.json()
    except ValueError:
        body = None
    return response.status_code, body if isinstance(body, dict) else None


def readiness_missing(target: ReadinessTarget, client: httpx.Client) -> list[str]:
    """What is not ready yet, in words (``[]`` when everything is); never raises for HTTP failures."""
    status, _ = _get_json(client, f"{target.web_url}/healthz")
    if status != 200:
        return [f"web {target.web_url}/healthz (HTTP {status or 'no answer'})"]
    missing = []
    status, table = _get_json(client, f"{target.web_url}/api/v1/routing-table/",
                              headers={"Authorization": f"Bearer {target.service_token}"})
    if status != 200 or table is None:
        return [f"routing table from web (HTTP {status or 'no answer'})"]
    ready_by_pool = {pool.get("name"): len(pool.get("replicas") or []) for pool in table.get("pools", [])}
    for name, desired in sorted(target.pools.items()):
        if ready_by_pool.get(name, 0) < desired:
            missing.append(f"pool {name}: {ready_by_pool.get(name, 0)}/{desired} workers ready")
    status, router = _get_json(client, f"{target.router_url}/ready")
    version = int(table.get("version", 0))
    if status != 200 or router is None:
        missing.append(f"router {target.router_url}/ready (HTTP {status or 'no answer'})")
    elif int(router.get("routing_table_version", -1)) < version and not missing:
        missing.append(f"router on routing table v{router.get('routing_table_version')} (published v{version})")
    return missing


def wait_until_ready(target: ReadinessTarget, *, stop: threading.Event, report: Callable[[str], None],
                     timeout_s: float, poll_s: float = 1.0, report_every_s: float = 30.0) -> bool:
    """Poll :func:`readiness_missing` until ready (True), ``stop`` is set or ``timeout_s`` passes (False).

    Every ``report_every_s`` seconds ``report`` gets a line naming what is still missing; at the timeout
    it gets a final line with the same list.
    """
    started = time.monotonic()
    next_report = started + report_every_s
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            missing = readiness_missing(target, client)
            if not missing:
                return True
            now = time.monotonic()
            if now - started >= timeout_s:
                report(f"not ready after {timeout_s:.0f} s; still waiting for: {'; '.join(missing)}")
                return False
            if now >= next_report:
                report(f"starting ({now - started:.0f} s): waiting for {'; '.join(missing)}")
                next_report = now + report_every_s
            stop.wait(poll_s)
    return False
