"""Local orchestrator backend: drives the local agent (``python -m inference_worker agent``) over HTTP.

One agent process per replica, named ``<pool>-<track>-<index>`` and labelled with the pool, pool
id, role, track and model version. Each applied track is also stored in the agent as a template
(``<pool>-<track>``) so a later ``scale_track`` can start replicas from zero and survives Celery
restarts. Traffic is Ferry's router's job: ``set_traffic_weights`` and ``switch_active`` only
validate and return ``ROUTING_TABLE``.

Failure policy matches the Kubernetes backend: transport errors, timeouts and 5xx are retried with
exponential backoff and then raise ``BackendUnavailable``; 404 -> ``NotFound``, 409 -> ``Conflict``,
400/422 -> ``InvalidSpec``; 401 -> ``BackendError`` (wrong token: retrying will not help). Deletes are
idempotent: stopping a process that is gone, or that another request is already stopping (the agent's
409), succeeds once it is gone (``_stop``).
"""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from apps.orchestrators.base import (
    LABEL_MODEL_VERSION,
    LABEL_POOL,
    LABEL_TRACK,
    MAX_LOG_BYTES,
    ROUTING_TABLE,
    TRACKS,
    BackendError,
    BackendUnavailable,
    Conflict,
    InvalidSpec,
    NotFound,
    ObservedReplica,
    ObservedState,
    ObservedTrack,
    OrchestratorBackend,
    PoolRef,
    PoolTrackSpec,
    log_text,
    validate_weights,
)

STOP_POLL_S = 0.5
"""Seconds between two stops of a process that another request is already stopping (HTTP 409)."""


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context of every agent client in this process (certifi's CA bundle, as httpx builds it).

    Built once: loading the CA bundle cost ~25 ms of CPU per client (0.2-0.3 s on a loaded host), and an Action
    opens a backend session per handler, so it sat in the path of every scale. The context is not changed after
    it is built, which is what sharing it between clients and threads needs.
    """
    return httpx.create_ssl_context()


class LocalAgentBackend(OrchestratorBackend):
    """OrchestratorBackend over one local agent at ``base_url`` (e.g. ``http://127.0.0.1:8100``)."""

    def __init__(self, base_url: str, token: str, *, max_attempts: int = 4, backoff_s: float = 0.2,
                 max_backoff_s: float = 3.0, timeout_s: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._client = httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {token}"},
                                    timeout=timeout_s, transport=transport, verify=tls_context())

    def close(self) -> None:
        self._client.close()

    # -- HTTP with the failure policy -------------------------------------------------------------

    def _request(self, method: str, path: str, *, timeout_s: float | None = None, **kwargs: Any) -> httpx.Response:
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        last: str = ""
        for attempt in range(self.max_attempts):
            try:
                response = self._client.request(method, path, **kwargs)
            except httpx.TransportError as exc:  # connect errors, timeouts, broken connections
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 400:
                    return response
                detail = _detail(response)
                if response.status_code >= 500:
                    last = f"HTTP {response.status_code}: {detail}"
                elif response.status_code == 404:
                    raise NotFound(f"{method} {path}: {detail}")
                elif response.status_code == 409:
                    raise Conflict(f"{method} {path}: {detail}")
                elif response.status_code in (400, 422):
                    raise InvalidSpec(f"{method} {path}: {detail}")
                elif response.status_code == 401:
                    raise BackendError(f"the local agent at {self.base_url} rejected the token")
                else:
                    raise BackendError(f"{method} {path}: HTTP {response.status_code} {detail}")
            if attempt + 1 < self.max_attempts:
                self._sleep(min(self.backoff_s * (2**attempt), self.max_backoff_s))
        raise BackendUnavailable(f"local agent {self.base_url} {method} {path} failed {self.max_attempts} times: {last}")

    # -- verbs ------------------------------------------------------------------------------------

    def apply_pool_track(self, spec: PoolTrackSpec) -> None:
        if spec.engine != "ferry":
            raise InvalidSpec(f"the local agent runs Ferry workers only, not {spec.engine} (use a Kubernetes cluster)")
        template = {
            "labels": spec.ferry_labels(),
            "args": spec.worker_args(),
            "env": {**spec.env, **spec.worker_token_env()},  # the token in the process env, never in args
            "drain_timeout_s": spec.drain_timeout_s,
            "replicas": spec.replicas,
        }
        self._request("PUT", f"/v1/templates/{spec.object_name}", json=template)
        self._converge(spec.pool, spec.track, template)

    def scale_track(self, pool: PoolRef, track: str, replicas: int) -> None:
        if not isinstance(replicas, int) or replicas < 0:
            raise InvalidSpec(f"replicas must be a non-negative integer, got {replicas!r}")
        name = f"{pool.pool_name}-{track}"
        template = self._request("GET", f"/v1/templates/{name}").json()
        if template.get("replicas") != replicas:
            template["replicas"] = replicas
            self._request("PUT", f"/v1/templates/{name}", json=template)
        self._converge(pool, track, template)

    def _converge(self, pool: PoolRef, track: str, template: Mapping[str, Any]) -> None:
        """Start missing indices, replace replicas whose args/env changed, stop extras (highest first)."""
        replicas = int(template["replicas"])
        prefix = f"{pool.pool_name}-{track}-"
        existing = {p["name"]: p for p in self._processes(pool, track)}
        wanted = [f"{prefix}{i}" for i in range(replicas)]
        for name in wanted:
            current = existing.get(name)
            if current is not None and (current["args"] != template["args"] or current["env"] != template["env"]):
                self._stop(name, current["drain_timeout_s"])
                current = None
            if current is None:
                self._start(name, template)
        extras = sorted((n for n in existing if n not in wanted), key=_index, reverse=True)
        for name in extras:
            self._stop(name, existing[name]["drain_timeout_s"])

    def _start(self, name: str, template: Mapping[str, Any]) -> None:
        body = {"name": name, "args": template["args"], "env": template["env"], "labels": template["labels"],
                "drain_timeout_s": template["drain_timeout_s"]}
        try:
            self._request("POST", "/v1/processes", json=body)
        except Conflict:
            pass  # a retried or duplicate start already created it

    def _stop(self, name: str, drain_timeout_s: float) -> None:
        """Stop process ``name`` and return once it is gone; idempotent.

        404 (already gone) is success: stopping twice is stopping once. 409 means another caller's stop (or
        a restart) is draining it: ask again every ``STOP_POLL_S`` until the agent answers 404 (gone) or 2xx
        (restarted meanwhile, now stopped by us), for at most ``drain_timeout_s + 15`` seconds of waiting.

        Raises:
            BackendUnavailable: still being stopped after that wait (retryable).
        """
        budget_s = drain_timeout_s + 15
        waited_s = 0.0
        while True:
            try:
                self._request("DELETE", f"/v1/processes/{name}", timeout_s=budget_s)
                return
            except NotFound:
                return
            except Conflict as exc:
                if waited_s >= budget_s:
                    raise BackendUnavailable(f"process {name!r} is still being stopped by another request after "
                                             f"{waited_s:.0f}s: {exc}") from exc
            self._sleep(STOP_POLL_S)
            waited_s += STOP_POLL_S

    def _processes(self, pool: PoolRef, track: str | None = None) -> list[dict[str, Any]]:
        selector = f"{LABEL_POOL}={pool.pool_name}" + (f",{LABEL_TRACK}={track}" if track else "")
        return self._request("GET", "/v1/processes", params={"selector": selector}).json()

    def set_traffic_weights(self, pool: PoolRef, weights: Mapping[str, int]) -> str:
        validate_weights(weights)
        return ROUTING_TABLE

    def switch_active(self, pool: PoolRef, active_track: str) -> str:
        if active_track not in TRACKS:
            raise InvalidSpec(f"unknown track {active_track!r}")
        return ROUTING_TABLE

    def delete_track(self, pool: PoolRef, track: str) -> None:
        for process in self._processes(pool, track):
            self._stop(process["name"], process["drain_timeout_s"])
        self._request("DELETE", f"/v1/templates/{pool.pool_name}-{track}")

    def restart_replica(self, pool: PoolRef, replica: str) -> None:
        process = self._request("GET", f"/v1/processes/{replica}").json()
        if process["labels"].get(LABEL_POOL) != pool.pool_name:
            raise NotFound(f"process {replica!r} does not belong to pool {pool.pool_name!r}")
        self._request("POST", f"/v1/processes/{replica}/restart", timeout_s=process["drain_timeout_s"] + 15)

    def observe(self, pool: PoolRef) -> ObservedState:
        templates = self._request("GET", "/v1/templates", params={"selector": f"{LABEL_POOL}={pool.pool_name}"})
        replicas: dict[str, list[ObservedReplica]] = {}
        for process in self._processes(pool):
            track = process["labels"].get(LABEL_TRACK, "")
            replicas.setdefault(track, []).append(ObservedReplica(
                name=process["name"], track=track, endpoint=process["endpoint"], ready=process["ready"],
                alive=process["alive"], version=process["labels"].get(LABEL_MODEL_VERSION, ""),
                restart_count=process["restart_count"], exit_code=process["exit_code"],
                exited_at=process.get("exited_at"), message=process.get("termination_message", ""),
            ))
        tracks: dict[str, ObservedTrack] = {}
        for template in templates.json().values():
            track = template["labels"][LABEL_TRACK]
            found = tuple(sorted(replicas.pop(track, []), key=lambda r: _index(r.name)))
            tracks[track] = ObservedTrack(track=track, desired_replicas=int(template["replicas"]),
                                          ready_replicas=sum(r.ready for r in found), replicas=found)
        for track, orphans in replicas.items():  # processes whose template was deleted under them
            found = tuple(sorted(orphans, key=lambda r: _index(r.name)))
            tracks[track] = ObservedTrack(track=track, desired_replicas=0,
                                          ready_replicas=sum(r.ready for r in found), replicas=found)
        return ObservedState(pool_name=pool.pool_name, tracks=tracks, active_track=None)

    def logs(self, pool: PoolRef, replica: str, tail: int = 100) -> str:
        """The agent's ``text/plain`` log tail, read in a bounded stream: more than 4x :data:`MAX_LOG_BYTES`
        or another content type is refused (``BackendUnavailable``) and no byte of a refused body is quoted
        (an ``agent_url`` may point at something that is not an agent)."""
        if tail < 1:
            raise InvalidSpec(f"tail must be >= 1, got {tail}")
        where = f"local agent {self.base_url} (logs of {replica!r})"
        try:
            with self._client.stream("GET", f"/v1/processes/{replica}/logs", params={"tail": tail}) as response:
                if response.status_code == 404:
                    raise NotFound(f"{where}: no such process")
                if response.status_code == 401:
                    raise BackendError(f"the local agent at {self.base_url} rejected the token")
                if response.status_code != 200:
                    raise BackendUnavailable(f"{where} answered HTTP {response.status_code}")
                content_type = response.headers.get("content-type", "").split(";")[0].strip()
                if content_type != "text/plain":
                    raise BackendUnavailable(f"{where} answered {content_type or 'no content type'}, not text/plain")
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > 4 * MAX_LOG_BYTES:
                        raise BackendUnavailable(f"{where} sent more than {4 * MAX_LOG_BYTES} bytes")
        except httpx.TransportError as exc:
            raise BackendUnavailable(f"{where}: {type(exc).__name__}") from exc
        return log_text(bytes(data))


def _index(name: str) -> int:
    suffix = name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else -1


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    return str(body.get("detail", body)) if isinstance(body, dict) else str(body)
