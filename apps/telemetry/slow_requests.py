"""The pool page's request timeline: the slowest recent requests' phases, collected from the data plane.

Routers and workers keep their recent requests' phase timings in memory and serve the slowest at
``GET /debug/slow-requests`` (:mod:`inference_worker.tracing`); they never write to the control plane. The
telemetry poller calls :func:`collect_slow_requests` every few polls: it reads every replica endpoint's and
router's list, joins a decode worker's record with the router's record of the same ``X-Request-Id``
(the router's phases first; the worker's shifted by the difference of their start times, so the rows share
the router's clock), keeps each pool's ``limit`` slowest and stores them as one snapshot per pool
(:func:`slow_requests_store`). The pool page reads :func:`slow_requests_latest`.

A row's phases are ``{"name", "lane", "start_ms", "duration_ms"}``; ``lane`` is one of :data:`LANES`. Container
phases (the router's wait for the upstream answer, the decode worker's whole hand-off) are left out: the
waterfall shows where time went, not who waited for whom.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

import httpx

from apps.telemetry.endpoints import ReplicaEndpoint, RouterEndpoint
from apps.telemetry.history import SignalHistory

logger = logging.getLogger(__name__)

PATH = "/debug/slow-requests"
SNAPSHOT_KIND = "slow"
LANES = ("router", "prefill", "transfer", "decode")
LANE_OF = {"router.admit": "router", "router.route": "router", "router.relay": "router",
           "prefill.queue": "prefill", "prefill.compute": "prefill", "prefill": "prefill",
           "kv.transfer": "transfer", "worker.parse": "decode", "decode.queue": "decode", "decode": "decode"}
"""Phase name -> waterfall lane; phases not named here are not drawn."""


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _well_formed(record: object) -> bool:
    """Whether ``record`` has what :func:`join_records` reads: ``request_id`` (str), ``start_s`` and
    ``duration_ms`` (numbers), ``phases`` (a list of ``{"name": str, "start_ms": number, "duration_ms": number}``)."""
    if not (isinstance(record, dict) and isinstance(record.get("request_id"), str) and _number(record.get("start_s"))
            and _number(record.get("duration_ms")) and isinstance(record.get("phases", []), list)):
        return False
    return all(isinstance(p, dict) and isinstance(p.get("name"), str) and _number(p.get("start_ms"))
               and _number(p.get("duration_ms")) for p in record.get("phases", []))


def _get(client: httpx.Client, url: str, limit: int) -> list[dict]:
    """The endpoint's records; [] when it does not answer, answers an error or something other than a
    ``{"requests": [...]}`` object (e.g. a registered router URL that is not a Ferry router). Malformed records are
    dropped: an endpoint's answer must never stop the poller (it also evaluates alerts and feeds autoscaling)."""
    try:
        response = client.get(url, params={"limit": limit})
        response.raise_for_status()
        payload = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        logger.info("slow requests of %s unavailable: %s", url, exc)
        return []
    records = payload.get("requests") if isinstance(payload, dict) else None
    if not isinstance(records, list):
        logger.info("slow requests of %s unavailable: not a {\"requests\": [...]} object", url)
        return []
    kept = [record for record in records if _well_formed(record)]
    if len(kept) < len(records):
        logger.info("slow requests of %s: %d malformed record(s) dropped", url, len(records) - len(kept))
    return kept


def _phases(record: dict, offset_ms: float) -> list[dict]:
    return [{"name": p["name"], "lane": LANE_OF[p["name"]], "start_ms": round(p["start_ms"] + offset_ms, 3),
             "duration_ms": p["duration_ms"]} for p in record.get("phases", []) if p.get("name") in LANE_OF]


def join_records(worker: dict, router: dict | None, *, replica: str) -> dict:
    """One waterfall row from a decode (or colocated) worker's record and the router's record of the same
    request (None: the worker's alone, e.g. a request sent to the worker directly)."""
    if router is None:
        return {"request_id": worker["request_id"], "replica": replica, "start_s": worker["start_s"],
                "duration_ms": worker["duration_ms"], "phases": _phases(worker, 0.0)}
    offset_ms = (worker["start_s"] - router["start_s"]) * 1e3
    router_phases = [p for p in _phases(router, 0.0) if p["name"] != "router.relay"]
    return {"request_id": router["request_id"], "replica": replica, "start_s": router["start_s"],
            "duration_ms": router["duration_ms"], "phases": router_phases + _phases(worker, offset_ms)}


def collect_slow_requests(endpoints: Iterable[ReplicaEndpoint], routers: Iterable[RouterEndpoint], *,
                          client: httpx.Client, limit: int = 20) -> dict[str, list[dict]]:
    """Pool id -> its ``limit`` slowest recent requests as waterfall rows (slowest first).

    Prefill workers' own records are not rows: their phases reach the row through the decode worker that
    asked them (its record carries them). An endpoint that does not answer is skipped (logged).
    """
    by_request: dict[str, dict] = {}
    for router in routers:
        parts = urlsplit(router.metrics_url)
        for record in _get(client, f"{parts.scheme}://{parts.netloc}{PATH}", limit):
            by_request[record["request_id"]] = record
    rows: dict[str, list[dict]] = {}
    for endpoint in endpoints:
        for record in _get(client, endpoint.url.rstrip("/") + PATH, limit):
            if record.get("role") == "prefill":
                continue
            row = join_records(record, by_request.get(record["request_id"]), replica=endpoint.replica)
            rows.setdefault(endpoint.pool_id, []).append(row)
    return {pool: sorted(found, key=lambda r: r["duration_ms"], reverse=True)[:limit] for pool, found in rows.items()}


def slow_requests_store(history: SignalHistory, *, pool_id: int | str, at_s: float, rows: list[dict]) -> None:
    """Store a pool's waterfall rows (replacing the previous snapshot)."""
    history.put_snapshot(SNAPSHOT_KIND, str(pool_id), {"pool_id": int(pool_id), "at": at_s, "requests": rows})


def slow_requests_latest(pool_id: int, history: SignalHistory | None = None) -> dict | None:
    """The pool's last stored snapshot ``{"pool_id", "at", "requests": [row, ...]}``, or None."""
    return (history or SignalHistory()).snapshot(SNAPSHOT_KIND, str(pool_id))
