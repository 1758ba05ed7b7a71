"""An in-process orchestrator backend that answers at once: for scale benchmarks and query-count tests.

:class:`InstantBackend` keeps every applied track in a dict. A track's replicas exist, are alive and ready
as soon as the track is applied or scaled (no processes, no network, no delay), so what a caller measures
against it is Ferry's own cost: the database, Redis and Python work of a reconcile or autoscale tick.
Replica names are ``<pool>-<track>-<i>`` and endpoints ``http://fake.invalid:<port>`` (``.invalid`` never
resolves, RFC 6761). Several clusters can share one instance: state is keyed by ``(namespace, pool id)``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from apps.orchestrators.base import (
    ROUTING_TABLE,
    NotFound,
    ObservedReplica,
    ObservedState,
    ObservedTrack,
    OrchestratorBackend,
    PoolRef,
    PoolTrackSpec,
    validate_weights,
)


@dataclass
class _Track:
    version: str
    replicas: int
    restarts: dict[int, int] = field(default_factory=dict)  # replica index -> restart count


class InstantBackend(OrchestratorBackend):
    """Every verb of :class:`OrchestratorBackend`, held in memory and answered at once (thread-safe).

    ``calls`` counts each verb's calls (``{"observe": 1000, ...}``) so a benchmark can check that it
    exercised the backend as expected. ``seed_track`` puts a track in place without an ``apply`` (a
    fleet that was already running before the tick being measured).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, int], dict[str, _Track]] = {}
        self._names: dict[tuple[str, int], str] = {}
        self.calls: dict[str, int] = {}

    def _count(self, verb: str) -> None:
        self.calls[verb] = self.calls.get(verb, 0) + 1

    @staticmethod
    def _key(pool: PoolRef) -> tuple[str, int]:
        return pool.namespace, pool.pool_id

    def seed_track(self, pool: PoolRef, track: str, *, version: str, replicas: int) -> None:
        """Make ``track`` of ``pool`` run ``replicas`` replicas of ``version`` (no call is counted)."""
        with self._lock:
            self._names[self._key(pool)] = pool.pool_name
            self._pools.setdefault(self._key(pool), {})[track] = _Track(version, replicas)

    def apply_pool_track(self, spec: PoolTrackSpec) -> None:
        self._count("apply_pool_track")
        self.seed_track(spec.pool, spec.track, version=spec.model.version, replicas=spec.replicas)

    def scale_track(self, pool: PoolRef, track: str, replicas: int) -> None:
        self._count("scale_track")
        with self._lock:
            seen = self._pools.get(self._key(pool), {}).get(track)
            if seen is None:
                raise NotFound(f"track {track!r} of pool {pool.pool_name!r} was never applied")
            seen.replicas = replicas

    def set_traffic_weights(self, pool: PoolRef, weights: Mapping[str, int]) -> str:
        self._count("set_traffic_weights")
        validate_weights(weights)
        return ROUTING_TABLE

    def switch_active(self, pool: PoolRef, active_track: str) -> str:
        self._count("switch_active")
        return ROUTING_TABLE

    def delete_track(self, pool: PoolRef, track: str) -> None:
        self._count("delete_track")
        with self._lock:
            self._pools.get(self._key(pool), {}).pop(track, None)

    def restart_replica(self, pool: PoolRef, replica: str) -> None:
        self._count("restart_replica")
        with self._lock:
            for name, seen in self._pools.get(self._key(pool), {}).items():
                for i in range(seen.replicas):
                    if f"{pool.pool_name}-{name}-{i}" == replica:
                        seen.restarts[i] = seen.restarts.get(i, 0) + 1
                        return
        raise NotFound(f"replica {replica!r} of pool {pool.pool_name!r} does not exist")

    def observe(self, pool: PoolRef) -> ObservedState:
        self._count("observe")
        with self._lock:
            tracks = {name: (seen.version, seen.replicas, dict(seen.restarts))
                      for name, seen in self._pools.get(self._key(pool), {}).items()}
        observed = {}
        for name, (version, replicas, restarts) in tracks.items():
            base = 20000 + 10 * (pool.pool_id % 4000)
            observed[name] = ObservedTrack(name, replicas, replicas, tuple(
                ObservedReplica(name=f"{pool.pool_name}-{name}-{i}", track=name,
                                endpoint=f"http://fake.invalid:{base + i}", ready=True, alive=True, version=version,
                                restart_count=restarts.get(i, 0))
                for i in range(replicas)))
        return ObservedState(pool_name=pool.pool_name, tracks=observed)

    def logs(self, pool: PoolRef, replica: str, tail: int = 100) -> str:
        self._count("logs")
        return ""
