"""Chaos matrix and soak: releases under steady load while one process at a time is killed with SIGKILL.

The whole product runs on the local backend with real model workers and the embedded PostgreSQL and Redis
(``bench/chaos_stack.py``: the launcher's process list under a supervisor that restarts what the bench
killed; it says there why this is a bench supervisor and not a restart-on-exit mode of ``make run``). A load
thread sends completions through the router at a steady rate (prompts and lengths from
``bench/workloads.py``: :func:`~bench.workloads.word_prompts` of 8..400 words as ``make run LOAD=1`` sends, so
prompts over the remote-prefill threshold go through the prefill pool and the KV transfer; one request every
``1 / --rate`` seconds, streamed with ``bench/serve_load.py``'s client), so every failure a client would see
is counted.

**Matrix**: for each scenario, for each target, one *cell*: start a rollout, kill the target once at its
worst phase of that scenario, let the supervisor (or, for model workers, the agent and reconcile) bring it
back, and wait for the rollout to finish and the fleet to settle.

Scenarios (the pools alternate between v1 and v2, so no reset is needed between cells):

* ``canary`` — the pools' other version with steps ``set_weight 50, pause 5 s, set_weight 100, pause 5 s``;
  expected final state ``promoted``, one track per pool on the target version;
* ``blue_green`` — preview, smoke test, ``pause 5 s``, switch, scale-down; expected ``promoted``;
* ``rollback`` — a canary held at 50% (``pause`` until resumed), then aborted: traffic back to stable and the
  canary track removed (phase ``reverting``); expected ``aborted``, every track on the original version.

Targets and the phase each is killed at (:data:`KILL_PHASES`): the Celery ``worker`` (Actions) and ``ticks``
(reconcile), ``beat``, the ``telemetry`` poller, the ``agent``, the ``web`` server, the ``router``, ``redis``,
and one model worker of the decode pool's stable track (``model:stable``) and of its new-version track
(``model:new``). Phases: ``scaling`` (a new-version track has desired replicas not yet ready), ``finalizing``
(canary at 100%, the stable track being replaced), ``preview_ready`` (blue-green preview up, smoke/steps),
``switch`` (blue-green switched, old track not yet scaled down) and ``reverting`` (after the abort). The
processes that make scaling happen (Actions, reconcile, agent, the replicas themselves, Redis as the broker,
the router that must follow the weights) are killed while scaling; those that only observe or serve the
last transition (beat, web, telemetry, the only new-version replica) at finalize. A phase that passes
before the bench sees it is recorded (``killed_at_phase`` False) and the kill happens at once.

Per cell: client requests and how many failed (after the router's retries), the final state and whether it
is the expected one, steps applied twice and Actions lost (``bench/chaos_accounting.py``), Actions re-run,
unexpected exits of other processes, ``restarted_s`` (kill -> the target runs again: the supervisor's restart,
Redis answering PING, or a replacement model worker ready in the agent's table) and ``recover_s`` (kill -> the
target back and the readiness check of ``make run`` passing: web healthy, every pool at its desired ready
replicas of that moment in the routing table, the router on that table; killed while scaling, it includes the
new replicas' model load, which the rollout would wait for anyway), and the seconds at which requests failed.
JSON to ``bench/results/chaos-<UTC time>.json`` and a table on stdout. A wall-clock budget (``--budget-min``,
default 45) stops the matrix: a cell starts only while a whole ``--cell-timeout-s`` is left, the others are
listed as not run. On the shared 2-core development machine a cell took 100-135 s plus up to a minute of
settling, so the 30 cells need more than 45 minutes there: run them in parts with ``--scenario``.

**Soak** (``--soak MINUTES``, default 30): no faults, the steady load only; every minute the RSS of every
process (each supervised process with its children, Redis, PostgreSQL, each model worker) is recorded, and
the growth between minute 5 (minute ``MINUTES - 1`` in a run shorter than 6 minutes) and the end; processes
that grew 5% or more are named. Each minute also records Redis' ``used_memory`` and the telemetry history's
share of it (``MEMORY USAGE`` of its keys), which fills for its 15-minute horizon and is flat after, Redis'
``INFO memory`` (data, overhead, clients, allocator) and every key grouped by kind (:func:`key_pattern`); the table
names the key kinds that grew, so a leak shows as a kind of key and not only as RSS. The 12-hour soak of seed
003 is ``nohup .venv/bin/python bench/chaos.py --soak 720 > chaos-soak.log 2>&1 &`` on a machine of its
own (a shared one measures the neighbours' pressure too); results land in the same JSON form.

Examples::

    .venv/bin/python bench/chaos.py --scenario canary --target worker        # one cell
    .venv/bin/python bench/chaos.py                                          # the whole matrix, 45 min budget
    .venv/bin/python bench/chaos.py --soak 30
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos_accounting import (  # noqa: E402
    actions_lost,
    actions_reexecuted,
    failed_requests,
    render_table,
    rollout_actions,
    rss_growth,
    steps_applied_twice,
)
from bench.chaos_stack import REDIS, Stack  # noqa: E402
from bench.serve_load import one_request  # noqa: E402
from bench.workloads import word_prompts  # noqa: E402

MODEL = "gemma-3-270m"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCENARIOS = ("canary", "blue_green", "rollback")
TARGETS = ("worker", "ticks", "beat", "telemetry", "agent", "web", "router", REDIS, "model:stable", "model:new")
KILL_PHASES = {
    "canary": {"worker": "scaling", "ticks": "scaling", "agent": "scaling", "router": "scaling", REDIS: "scaling",
               "model:stable": "scaling", "beat": "finalizing", "telemetry": "finalizing", "web": "finalizing",
               "model:new": "finalizing"},
    "blue_green": {"worker": "switch", "ticks": "switch", "agent": "switch", "router": "switch", REDIS: "switch",
                   "model:stable": "preview_ready", "beat": "preview_ready", "telemetry": "preview_ready",
                   "web": "switch", "model:new": "switch"},
    "rollback": dict.fromkeys(TARGETS, "reverting"),
}
"""Scenario -> target -> the phase it is killed at (module docstring)."""
EXPECTED_STATE = {"canary": "promoted", "blue_green": "promoted", "rollback": "aborted"}
TERMINAL_STATES = ("promoted", "aborted", "failed")
DECODE_POOL = "decode"
RSS_GROWTH_LIMIT = 0.05
"""The soak's bound on each process's RSS growth between minute 5 and the end (issue 20, acceptance 3)."""


@dataclass
class Cell:
    """One cell's record (times in seconds from the cell's start)."""

    scenario: str
    target: str
    phase: str
    expected_state: str
    rollout_id: int | None = None
    killed: str = ""
    killed_at_phase: bool = False
    kill_at_s: float | None = None
    restarted_s: float | None = None
    recover_s: float | None = None
    final_state: str = ""
    final_state_ok: bool = False
    final_detail: list[str] = field(default_factory=list)
    num_requests: int = 0
    num_failed: int = 0
    errors: list[str] = field(default_factory=list)
    error_counts: list[tuple[int, str]] = field(default_factory=list)
    """``(count, error)`` of the cell's failed requests, most frequent first (errors cut to 160 characters)."""
    failed_at_s: list[float] = field(default_factory=list)
    failures: list[tuple[float, str]] = field(default_factory=list)
    """``(seconds from the cell's start, error cut to 100 characters)`` of each failed request (first 100)."""
    applied_twice: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    reexecuted: list[str] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    message: str = ""
    duration_s: float = 0.0
    note: str = ""


class Load(threading.Thread):
    """One streamed completion through the router every ``1 / rate`` seconds (a steady rate), whatever the
    answers; ``results`` holds ``(started_monotonic, ok, error)``. A request is ok only when its stream ended
    with ``[DONE]`` after all ``max_tokens`` tokens (``ignore_eos``: fewer means the worker aborted it)."""

    def __init__(self, router_url: str, rate: float, seed: int, api_key: str) -> None:
        super().__init__(name="chaos-load", daemon=True)
        self.url = router_url.rstrip("/") + "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.interval_s = 1.0 / rate
        self.requests = word_prompts(4096, seed, input_words=(8, 400), output_tokens=(4, 12))
        self.results: list[tuple[float, bool, str]] = []
        self.in_flight: dict[int, float] = {}
        """Requests not answered yet: id -> start (``time.monotonic()``)."""
        self.stop_event = threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=60.0, headers=self.headers) as client:
            tasks: set[asyncio.Task] = set()
            index = 0
            next_at = time.monotonic()
            while not self.stop_event.is_set():
                request = self.requests[index % len(self.requests)]
                index += 1
                task = asyncio.create_task(self._one(client, request.prompt, request.max_tokens))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += self.interval_s
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=90)

    async def _one(self, client: httpx.AsyncClient, prompt: str, max_tokens: int) -> None:
        started = time.monotonic()
        key = id(asyncio.current_task())
        self.in_flight[key] = started
        try:
            result = await one_request(client, self.url, MODEL, prompt, max_tokens, chat=False)
        finally:
            self.in_flight.pop(key, None)
        ok, error = result.ok, result.error
        if ok and result.num_output_tokens != max_tokens:  # ignore_eos: only an abort ends a stream early
            ok, error = False, f"finished early: {result.num_output_tokens} of {max_tokens} tokens (aborted)"
        self.results.append((started, ok, error[:200]))

    def wait_answered(self, before: float, timeout_s: float = 75.0) -> None:
        """Wait (up to ``timeout_s``; the client's own timeout is 60 s) until every request started before
        ``before`` has its result: a cell counts the requests it started, including the slow last ones."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(t < before for t in list(self.in_flight.values())):
            time.sleep(0.5)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(120)


class Api:
    """The REST API as the operator (token from ``ferry_setup``)."""

    def __init__(self, web_url: str, token: str) -> None:
        self.client = httpx.Client(base_url=web_url + "/api/v1", headers={"Authorization": f"Token {token}"},
                                   timeout=10.0)

    def get(self, path: str, **params) -> object:
        response = self.client.get(path, params=params)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict | None = None) -> dict:
        response = self.client.post(path, json=body or {})
        if response.status_code >= 400:
            raise RuntimeError(f"POST {path}: HTTP {response.status_code} {response.text[:300]}")
        return response.json()

    def rows(self, path: str, **params) -> list[dict]:
        """Every row of a paginated list endpoint."""
        rows, page = [], 1
        while True:
            body = self.get(path, page=page, page_size=500, **params)
            rows += body["results"]
            if not body.get("next"):
                return rows
            page += 1

    def get_or_none(self, path: str) -> object | None:
        try:
            return self.get(path)
        except httpx.HTTPError:
            return None


def pools_by_name(api: Api) -> dict[str, dict]:
    return {p["name"]: p for p in api.rows("/pools/")}


def desired_replicas(pools: dict[str, dict]) -> dict[str, int]:
    return {name: sum(t["replicas"] for t in pool["tracks"]) for name, pool in pools.items()}


def wait_ready(stack: Stack, api: Api, timeout_s: float) -> list[str]:
    """Poll until the readiness check passes for the pools' desired replicas; returns what is still missing
    (empty: ready)."""
    deadline = time.monotonic() + timeout_s
    missing = ["not checked"]
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                missing = stack.readiness(desired_replicas(pools_by_name(api)), client)
            except httpx.HTTPError as exc:
                missing = [f"web API: {exc!r}"]
            if not missing:
                return []
            time.sleep(1.0)
    return missing


def router_id(api: Api, router_url: str) -> int:
    """The id of the registered router at ``router_url`` (``ferry_setup``'s demo router; rollouts name routers by
    id).

    Raises:
        LookupError: no router registered at that URL.
    """
    for row in api.rows("/routers/"):
        if row["url"].rstrip("/") == router_url.rstrip("/"):
            return row["id"]
    raise LookupError(f"no router registered at {router_url}")


def rollout_body(scenario: str, pools: dict[str, dict], target_version: int, router: int) -> dict:
    """The ``POST /api/v1/rollouts/`` body of a scenario (module docstring)."""
    steps = {
        "canary": [{"set_weight": 50}, {"pause": {"seconds": 5}}, {"set_weight": 100}, {"pause": {"seconds": 5}}],
        "blue_green": [{"pause": {"seconds": 5}}],
        "rollback": [{"set_weight": 50}, {"pause": {}}],
    }[scenario]
    return {"name": f"chaos-{scenario}-{int(time.time())}", "pools": sorted(p["id"] for p in pools.values()),
            "target_model_version": target_version,
            "strategy": "blue_green" if scenario == "blue_green" else "canary", "router": router,
            "steps": steps, "gates": []}


def phase_reached(phase: str, rollout: dict, decode_pool: dict, replicas: list[dict]) -> bool:
    """Whether ``rollout`` (its API row) is in ``phase`` now (module docstring), given the decode pool and its
    replica rows."""
    state, current = rollout["state"], rollout["phase"]
    if phase == "scaling":
        new = [t for t in decode_pool["tracks"] if t["model_version"] == rollout["target_model_version"]]
        if state != "progressing" or current not in ("steps", "preview") or not new:
            return False
        ready = sum(1 for r in replicas if r["track"] == new[0]["name"] and r["ready"] and r["alive"])
        return new[0]["replicas"] > 0 and ready < new[0]["replicas"]
    if phase == "finalizing":
        return current == "finalizing"
    if phase == "preview_ready":
        return current in ("smoke", "steps") and rollout["strategy"] == "blue_green"
    if phase == "switch":
        return current == "switched"
    if phase == "reverting":
        return current == "reverting"
    raise ValueError(f"unknown phase {phase!r}")


def kill_name(target: str, rollout: dict, decode_pool: dict) -> str:
    """``model:stable``/``model:new`` -> ``model:decode:<track>`` (the track serving the stable/target
    version); other targets unchanged."""
    if not target.startswith("model:"):
        return target
    want_new = target == "model:new"
    for track in decode_pool["tracks"]:
        is_new = track["model_version"] == rollout["target_model_version"]
        if is_new == want_new and track["replicas"] > 0:
            return f"model:{DECODE_POOL}:{track['name']}"
    raise LookupError(f"decode pool has no {'new' if want_new else 'stable'} track with replicas")


def final_check(scenario: str, rollout: dict, pools: dict[str, dict], original_version: int) -> list[str]:
    """What differs from the scenario's expected end (empty: as expected)."""
    problems = []
    if rollout["state"] != EXPECTED_STATE[scenario]:
        problems.append(f"rollout {rollout['state']} ({rollout['message'][:160]})")
    version = rollout["target_model_version"] if scenario != "rollback" else original_version
    for name, pool in sorted(pools.items()):
        versions = sorted({t["model_version"] for t in pool["tracks"] if t["replicas"] > 0 or t["weight"] > 0})
        if versions != [version] or len(pool["tracks"]) != 1:
            problems.append(f"pool {name}: tracks {[(t['name'], t['model_version'], t['replicas']) for t in pool['tracks']]}"
                            f" (expected one track on version {version})")
    return problems


def _track_removed(api: Api, killed_name: str) -> bool:
    """Whether ``model:<pool>:<track>``'s track no longer exists (False when the API does not answer)."""
    _, pool, track = killed_name.split(":", 2)
    try:
        return track not in {t["name"] for t in pools_by_name(api)[pool]["tracks"]}
    except (httpx.HTTPError, KeyError):
        return False


def _retrying(read, attempts: int = 10, pause_s: float = 3.0):  # noqa: ANN001, ANN202 - a callable and its value
    """``read()``, tried again on an HTTP error (a web server just restarted or shedding load) up to ``attempts``
    times; the last error propagates."""
    for _ in range(attempts - 1):
        try:
            return read()
        except httpx.HTTPError:
            time.sleep(pause_s)
    return read()


def run_cell(stack: Stack, api: Api, load: Load, scenario: str, target: str, *, cell_timeout_s: float) -> Cell:
    """One cell (module docstring). Never raises for the product's failures: they are recorded."""
    cell = Cell(scenario, target, KILL_PHASES[scenario][target], EXPECTED_STATE[scenario])
    missing = wait_ready(stack, api, 300)
    if missing:
        cell.note = f"fleet not ready before the cell: {'; '.join(missing)}"
        return cell
    pools = pools_by_name(api)
    original = pools[DECODE_POOL]["model_version"]
    versions = [v["id"] for v in api.rows("/model-versions/") if v["name"] == MODEL]
    target_version = next(v for v in versions if v != original)
    exits_before = {name: len(p.unexpected_exits) for name, p in stack.procs.items()}
    start = time.monotonic()
    rollout = api.post("/rollouts/", rollout_body(scenario, pools, target_version,
                                                  router_id(api, stack.config.router_url)))
    cell.rollout_id = rid = rollout["id"]
    api.post(f"/rollouts/{rid}/start/")
    deadline = start + cell_timeout_s
    aborted = False
    kill_at, killed_pid, killed_name = None, 0, target
    while time.monotonic() < deadline:
        rollout = api.get_or_none(f"/rollouts/{rid}/")
        if rollout is None:  # the web server may be the one just killed
            time.sleep(0.5)
            continue
        if scenario == "rollback" and rollout["state"] == "paused" and not aborted:
            api.post(f"/rollouts/{rid}/abort/")
            aborted = True
            continue
        if kill_at is None:
            try:
                decode = pools_by_name(api)[DECODE_POOL]
                replicas = api.rows("/replicas/", pool=decode["id"])
            except httpx.HTTPError:  # a slow answer on a busy machine: look again
                time.sleep(0.5)
                continue
            hit = phase_reached(cell.phase, rollout, decode, replicas)
            if hit or rollout["state"] in TERMINAL_STATES:
                cell.killed_at_phase = hit
                try:
                    killed_name = kill_name(target, rollout, decode)
                    cell.killed, killed_pid = stack.kill(killed_name)
                except LookupError as exc:
                    cell.killed = f"nothing killed: {exc}"
                kill_at = time.monotonic()
                cell.kill_at_s = round(kill_at - start, 2)
                break
        time.sleep(0.2)
    if kill_at is not None and killed_pid:
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if cell.restarted_s is None:
                    restarted = stack.restarted_at(killed_name, killed_pid)
                    if restarted is not None:
                        cell.restarted_s = round(restarted - kill_at, 2)
                    elif killed_name.startswith("model:") and _track_removed(api, killed_name):
                        # the rollout removed the killed replica's track (promoted or reverted): nothing restarts it
                        cell.note = f"{killed_name} removed by the rollout: no restart to wait for"
                        break
                if cell.restarted_s is not None:
                    try:
                        if not stack.readiness(desired_replicas(pools_by_name(api)), client):
                            cell.recover_s = round(time.monotonic() - kill_at, 2)
                            break
                    except httpx.HTTPError:
                        pass
                time.sleep(0.5)
    while time.monotonic() < deadline:  # the rollout's end, aborting a rollback cell whose pause came after the kill
        rollout = api.get_or_none(f"/rollouts/{rid}/")
        if rollout is not None and scenario == "rollback" and rollout["state"] == "paused" and not aborted:
            api.post(f"/rollouts/{rid}/abort/")
            aborted = True
        if rollout is not None and rollout["state"] in TERMINAL_STATES and not rollout["progress"].get("cleanup"):
            break
        time.sleep(1.0)
    settle_missing = wait_ready(stack, api, max(30.0, deadline - time.monotonic()))
    settle_deadline = time.monotonic() + 120  # a track_delete drains its replicas (demo: up to 60 s) first
    actions = []
    while time.monotonic() < settle_deadline:  # Actions still queued get 2 minutes to run before they count as lost
        try:
            actions = rollout_actions(api.rows("/actions/"), rid)
        except httpx.HTTPError:  # a busy web server's 503: look again
            time.sleep(2.0)
            continue
        if not any(a["status"] in ("pending", "running") for a in actions):
            break
        time.sleep(2.0)
    end = time.monotonic()
    rollout, pools = _retrying(lambda: (api.get(f"/rollouts/{rid}/"), pools_by_name(api)))
    cell.final_state, cell.message = rollout["state"], rollout["message"]
    cell.final_detail = final_check(scenario, rollout, pools, original) + [f"not ready: {m}" for m in settle_missing]
    cell.final_state_ok = not cell.final_detail
    load.wait_answered(end)  # requests still streaming at the cell's end were left out of every cell
    results = list(load.results)
    cell.num_requests, cell.num_failed, cell.errors = failed_requests(results, start, end)
    cell.error_counts = [(n, e) for e, n in Counter(r[2][:160] for r in results
                                                    if start <= r[0] < end and not r[1]).most_common()]
    cell.failures = sorted((round(r[0] - start, 1), r[2][:100]) for r in results
                           if start <= r[0] < end and not r[1])[:100]
    cell.failed_at_s = sorted(round(r[0] - start, 1) for r in results if start <= r[0] < end and not r[1])[:100]
    cell.applied_twice = steps_applied_twice(actions, rid)
    cell.lost = actions_lost(actions, rid, num_track_changes=int(rollout["progress"].get("num_track_changes", 0)))
    cell.reexecuted = actions_reexecuted(actions, rid)
    cell.unexpected_exits = [f"{name} exited with {code}" for name, p in stack.procs.items()
                             for _, code in p.unexpected_exits[exits_before.get(name, 0):]]
    cell.duration_s = round(end - start, 1)
    return cell


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")


def write_results(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}-{utc_stamp()}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def run_matrix(stack: Stack, api: Api, load: Load, args: argparse.Namespace) -> dict:
    started = time.monotonic()
    budget_s = args.budget_min * 60
    cells: list[dict] = []
    for scenario in args.scenario:
        for target in args.target:
            remaining = budget_s - (time.monotonic() - started)
            if remaining < args.cell_timeout_s:
                cells.append(asdict(Cell(scenario, target, KILL_PHASES[scenario][target], EXPECTED_STATE[scenario],
                                         note="not run: wall-clock budget spent")))
                continue
            print(f"chaos | cell {scenario} x {target} (kill at {KILL_PHASES[scenario][target]})", flush=True)
            try:
                cell = asdict(run_cell(stack, api, load, scenario, target, cell_timeout_s=args.cell_timeout_s))
            except (httpx.HTTPError, RuntimeError, LookupError) as exc:  # the API refused or stayed away: the cell says so
                cell = asdict(Cell(scenario, target, KILL_PHASES[scenario][target], EXPECTED_STATE[scenario],
                                   note=f"cell broke off: {type(exc).__name__}: {exc}"))
            cells.append(cell)
            print(f"chaos | {json.dumps(cell, default=str)}", flush=True)
    return {"cells": cells, "table": render_table(cells)}


REDIS_MEMORY_FIELDS = ("used_memory", "used_memory_rss", "used_memory_peak", "used_memory_overhead",
                       "used_memory_startup", "used_memory_dataset", "used_memory_scripts", "number_of_cached_scripts",
                       "mem_clients_normal", "allocator_allocated", "allocator_active", "allocator_resident",
                       "mem_allocator")
"""``INFO memory`` fields each soak minute records (Redis 6.2's names), to tell data from allocator and clients."""
_KEY_PART = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{8,}|[A-Za-z0-9]{16,}|[0-9]+")


def key_pattern(key: bytes) -> str:
    """A Redis key with its variable parts (hex digests, numbers, long random names) replaced by ``*``, so keys
    of one kind group together: ``ferry:telemetry:history:pool:12:recent`` -> ``ferry:telemetry:history:pool:*:recent``."""
    return _KEY_PART.sub(b"*", key).decode(errors="replace")


def redis_memory(stack: Stack) -> dict:
    """Redis memory each soak minute: ``INFO memory`` (:data:`REDIS_MEMORY_FIELDS`), the telemetry history's share
    (``MEMORY USAGE`` of every ``*telemetry:history:*`` key, ``SAMPLES 0``: every element counted), and every key
    grouped by :func:`key_pattern` (pattern -> [keys, bytes]); ``None`` values while Redis does not answer."""
    import redis

    try:
        client = redis.Redis.from_url(stack.redis.url, socket_timeout=5)
        keys = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)
        sizes = [int(n or 0) for n in pipe.execute()] if keys else []
        patterns: dict[str, list[int]] = {}
        history = history_keys = 0
        for key, size in zip(keys, sizes, strict=True):
            entry = patterns.setdefault(key_pattern(key), [0, 0])
            entry[0] += 1
            entry[1] += size
            if b"telemetry:history:" in key:
                history += size
                history_keys += 1
        info = client.info("memory")
        clients = client.info("clients")
        return {"redis_used_memory": int(info["used_memory"]), "history_bytes": history,
                "history_keys": history_keys, "redis_info": {**{k: info.get(k) for k in REDIS_MEMORY_FIELDS},
                                                             "connected_clients": clients.get("connected_clients")},
                "redis_keys": dict(sorted(patterns.items()))}
    except redis.RedisError:
        return {"redis_used_memory": None, "history_bytes": None, "history_keys": None}


def run_soak(stack: Stack, args: argparse.Namespace) -> dict:
    samples = []
    started = time.monotonic()
    for minute in range(args.soak + 1):
        while time.monotonic() < started + minute * 60:
            time.sleep(1.0)
        sample = {"minute": minute, "rss_bytes": stack.rss_bytes(), **redis_memory(stack)}
        samples.append(sample)
        print(f"chaos | soak minute {minute}: " + ", ".join(f"{k} {v / 2**20:.0f} MiB"
                                                           for k, v in sorted(sample["rss_bytes"].items()))
              + ("; redis not answering" if sample["redis_used_memory"] is None else
                 f"; redis used_memory {sample['redis_used_memory'] / 2**20:.2f} MiB, telemetry history "
                 f"{sample['history_bytes'] / 2**10:.0f} KiB in {sample['history_keys']} keys"), flush=True)
    baseline = min(5, max(0, args.soak - 1))
    growth = rss_growth(samples, baseline_minute=baseline)
    lines = [f"{'process':<28} {'base MiB':>9} {'end MiB':>9} {'growth':>8}"]
    for name, g in growth.items():
        ratio = "-" if g["growth"] is None else f"{100 * g['growth']:+.1f}%"
        base = "-" if g["base_bytes"] is None else f"{g['base_bytes'] / 2**20:.1f}"
        end = "-" if g["end_bytes"] is None else f"{g['end_bytes'] / 2**20:.1f}"
        lines.append(f"{name:<28} {base:>9} {end:>9} {ratio:>8}")
    for label, key, unit in (("redis used_memory", "redis_used_memory", 2**20), ("telemetry history", "history_bytes", 2**20)):
        base, end = samples[baseline].get(key), samples[-1].get(key)
        if base is not None and end is not None:
            lines.append(f"{label:<28} {base / unit:>9.2f} {end / unit:>9.2f} "
                         f"{'-' if not base else f'{100 * (end - base) / base:+.1f}%':>8}")
    base_info, end_info = samples[baseline].get("redis_info") or {}, samples[-1].get("redis_info") or {}
    for name in REDIS_MEMORY_FIELDS:
        base, end = base_info.get(name), end_info.get(name)
        if (name != "used_memory" and isinstance(base, int) and isinstance(end, int)
                and name.startswith(("used_memory", "mem_", "allocator_"))):
            lines.append(f"{'redis ' + name:<28} {base / 2**20:>9.2f} {end / 2**20:>9.2f} "
                         f"{'-' if not base else f'{100 * (end - base) / base:+.1f}%':>8}")
    base_keys, end_keys = samples[baseline].get("redis_keys") or {}, samples[-1].get("redis_keys") or {}
    moved = sorted(set(base_keys) | set(end_keys),
                   key=lambda k: -abs(end_keys.get(k, [0, 0])[1] - base_keys.get(k, [0, 0])[1]))
    for pattern in moved[:8]:
        (n0, b0), (n1, b1) = base_keys.get(pattern, [0, 0]), end_keys.get(pattern, [0, 0])
        lines.append(f"redis keys {pattern[:40]}: {n0} -> {n1} keys, {b0 / 2**10:.1f} -> {b1 / 2**10:.1f} KiB")
    over = sorted(name for name, g in growth.items() if g["growth"] is not None and g["growth"] >= RSS_GROWTH_LIMIT)
    lines.append(f"grew {100 * RSS_GROWTH_LIMIT:.0f}% or more from minute {baseline}: {', '.join(over) or 'none'}")
    return {"samples": samples, "baseline_minute": baseline, "growth": growth, "over_limit": over,
            "table": "\n".join(lines)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only this scenario (repeatable)")
    parser.add_argument("--target", action="append", choices=TARGETS, help="kill only this target (repeatable)")
    parser.add_argument("--soak", type=int, nargs="?", const=30, default=None, metavar="MINUTES",
                        help="soak instead of the matrix: steady load, RSS every minute (default 30 minutes)")
    parser.add_argument("--rate", type=float, default=0.5,
                        help="client requests per second, steady (default 0.5, as make run LOAD=1)")
    parser.add_argument("--budget-min", type=float, default=45.0, help="wall-clock budget of the matrix, minutes")
    parser.add_argument("--cell-timeout-s", type=float, default=420.0, help="the most one cell may take")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (bench/workloads.py)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0,
                        help="how long the stack may take to become ready (a loaded machine loads models slowly)")
    parser.add_argument("--var-dir", type=Path, default=None, help="runtime files (default: a fresh temp dir, removed)")
    parser.add_argument("--ports", default=None, metavar="FIRST-LAST",
                        help="take the web, router, agent, Redis and PostgreSQL ports from this range (default: any free)")
    args = parser.parse_args(argv)
    args.scenario = args.scenario or list(SCENARIOS)
    args.target = args.target or list(TARGETS)
    if args.rate <= 0:
        parser.error("--rate must be > 0")
    if args.ports is not None:
        first, _, last = args.ports.partition("-")
        if not (first.isdigit() and last.isdigit() and 1024 <= int(first) <= int(last) <= 65535):
            parser.error("--ports must be FIRST-LAST, e.g. 8500-8599")
        args.ports = (int(first), int(last))
    if args.soak is not None and args.soak < 1:
        parser.error("--soak MINUTES must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (and SIGINT, which a shell ignores in a background job) stop the run through the finally below,
    # so the stack and its model workers are stopped, not left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    var_dir = args.var_dir
    if var_dir is None:
        # 0700 as make run's var/: a root-started PostgreSQL (run as nobody) gets search through its group
        # (0710, apps.setup.embedded_postgresql), which Django's start-up private_dir keeps. A 0711 var/ lost its
        # "other" search bit to private_dir and the database PANICked at its first timed checkpoint.
        var_dir = Path(tempfile.mkdtemp(prefix="ferry-chaos-"))
    stack = Stack(var_dir, throwaway=args.var_dir is None, port_range=args.ports)
    load = None
    payload: dict = {"started_at": utc_stamp(), "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        stack.start()
        users = {u["username"]: u for u in stack.summary.get("users", [])}
        api = Api(stack.config.web_url, users["operator"]["token"])
        missing = wait_ready(stack, api, args.ready_timeout_s)
        if missing:
            print(f"chaos | not ready after {args.ready_timeout_s:g} s: {'; '.join(missing)}", flush=True)
            return 1
        load = Load(stack.config.router_url, args.rate, args.seed, stack.client_api_key)
        load.start()
        if args.soak is not None:
            payload["soak"] = run_soak(stack, args)
            table = payload["soak"]["table"]
        else:
            payload.update(run_matrix(stack, api, load, args))
            table = payload["table"]
    finally:
        if load is not None:
            load.stop()
            payload["num_requests"] = len(load.results)
            payload["num_failed"] = sum(1 for r in load.results if not r[1])
            errors = Counter(r[2][:160] for r in load.results if not r[1])
            payload["errors"] = [{"error": e, "count": n} for e, n in errors.most_common(20)]
            t0 = load.results[0][0] if load.results else 0.0
            payload["failed_at_s"] = sorted(round(r[0] - t0, 1) for r in load.results if not r[1])[:500]
        payload["leftovers_killed"] = stack.stop()
        if args.var_dir is None:
            shutil.rmtree(var_dir, ignore_errors=True)
    path = write_results("chaos-soak" if args.soak is not None else "chaos", payload)
    print(table)
    print(f"chaos | client requests {payload.get('num_requests')}, failed {payload.get('num_failed')}: "
          + "; ".join(f"{e['count']} x {e['error']}" for e in payload.get("errors", [])[:5]))
    print(f"chaos | wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
