"""The reconcile tick: repair stuck Actions, observe every pool, converge desired vs observed, publish.

One tick (``operations.reconcile``, every ``FERRY_RECONCILE_INTERVAL_S`` from beat):

1. Running Actions whose lease expired go back to pending and are enqueued again (takeover: the
   handler re-runs and converges; handlers are idempotent, so what was applied is not applied
   twice). Pending Actions not queued for ``FERRY_ACTION_REQUEUE_S`` are enqueued again.
2. Each pool's backend is observed (one backend session per cluster); the cluster's ``status``
   becomes ``ready`` or ``unreachable``; the pool's ``Replica`` rows are refreshed.
3. For a pool with no pending or running Action (neither one holding its lock nor a track Action of
   :mod:`apps.operations.tracks`, e.g. a rollout's ``pool.track_delete`` still stopping a track): a track whose backend replica count or model version differs
   from the desired one (or a backend track that is not desired) -> a ``pool.apply`` Action; else a
   replica that is not alive (a crashed worker) -> a ``pool.restart_replica`` Action, with backoff
   (:func:`restart_backoff_s`) counted from its death, and a reason that carries its termination
   message (a worker whose model fails to load exits non-zero and says why); else a replica the
   routers' circuit breaker ejected ``FERRY_EJECTIONS_BEFORE_RESTART`` times within
   ``FERRY_EJECTION_RESTART_WINDOW_S`` since its last restart (seed 003 9.1: eject, then restart) -> a
   ``pool.restart_replica`` Action naming the ejections (:func:`replicas_ejected_repeatedly`). Their
   idempotency keys name the pool, the drift and the pool's latest Action id, so a repeated tick
   returns the same Action instead of creating another, while a later drift gets a new key.
4. The routing table is published (its version changes only with its content).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import redis
from django.conf import settings
from django.db.models import Q

from apps.core.errors import ConflictError
from apps.fleet.models import Cluster, Pool
from apps.fleet.services import replicas_refresh_many, routing_table_publish
from apps.operations import services
from apps.operations.backends import backend_for_cluster, close_backend, pool_ref
from apps.operations.models import Action
from apps.operations.pool_actions import POOL_APPLY, POOL_RESTART_REPLICA
from apps.orchestrators.base import BackendError, BackendUnavailable, ObservedReplica, ObservedState
from apps.telemetry.history import SignalHistory
from apps.telemetry.selectors import telemetry_histories, telemetry_history

logger = logging.getLogger(__name__)

RECONCILE = "reconcile"
"""The requester of the Actions a reconcile tick creates (their first log line: ``requested by reconcile``)."""


@dataclass
class ReconcileResult:
    """Counts of one tick."""

    taken_over: int = 0
    requeued: int = 0
    pools_observed: int = 0
    pools_unreachable: int = 0
    applies: int = 0
    restarts: int = 0
    routing_table_version: int = 0
    routing_table_changed: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def pool_drift(pool: Pool, observed: ObservedState) -> dict[str, str]:
    """Tracks whose observed state differs from the desired one: track -> what differs ("" = none).

    Differences: backend replica count != desired, fewer replicas (alive or dead) than desired (the
    backend kept the count but lost the processes, e.g. a local agent restarted after a clean stop), a
    replica running another model version, a backend track that is not desired, a desired track with
    replicas that the backend lacks. Dead replicas that still exist are restarted separately, so only
    missing ones count here; surplus replicas (pods still terminating) are not drift.
    """
    drift: dict[str, str] = {}
    desired = {t.name: t for t in pool.tracks.all()}
    for name, track in desired.items():
        seen = observed.tracks.get(name)
        if seen is None:
            if track.replicas:
                drift[name] = f"missing in the backend (desired {track.replicas})"
            continue
        if seen.desired_replicas != track.replicas:
            drift[name] = f"backend replicas {seen.desired_replicas} != desired {track.replicas}"
            continue
        if len(seen.replicas) < track.replicas:
            drift[name] = f"backend runs {len(seen.replicas)} replicas, desired {track.replicas}"
            continue
        wrong = sorted(r.name for r in seen.replicas if r.version and r.version != track.model_version.version)
        if wrong:
            drift[name] = f"replicas {wrong} run another version than {track.model_version.version}"
    for name, seen in observed.tracks.items():
        if name not in desired and (seen.desired_replicas or seen.replicas):
            drift[name] = "not desired"
    return drift


def _latest_action_id(pool: Pool) -> int:
    return Action.objects.filter(pool=pool).order_by("-id").values_list("id", flat=True).first() or 0


def _key(pool: Pool, what: str, payload: object) -> str:
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return f"reconcile:pool-{pool.pk}:{what}:{digest}:after-{_latest_action_id(pool)}"


def _create(pool: Pool, kind: str, params: dict, key: str, reason: str) -> bool:
    try:
        action, created = services.action_create(kind=kind, target_type="pool", target_id=str(pool.pk),
                                                 target_repr=str(pool), pool=pool, params=params,
                                                 idempotency_key=key, requester=RECONCILE)
    except ConflictError:
        return False  # someone else locked the pool since we looked: next tick
    if created:
        services.action_log_append(action_id=action.pk, message=f"reconcile: {reason}")
    return created


def restart_backoff_s(restart_count: int) -> float:
    """Seconds a dead replica waits, from its death, before reconcile restarts it again.

    ``0`` for its first death (a one-off crash recovers at once), then Kubernetes' CrashLoopBackOff
    sequence (kubelet: 10 s doubling per restart, capped at 5 minutes): ``min(base * 2**(n - 1), max)``
    after ``n`` restarts, with ``base`` = ``FERRY_RESTART_BACKOFF_S`` and ``max`` =
    ``FERRY_RESTART_BACKOFF_MAX_S``. On Kubernetes the kubelet restarts a crashed container itself
    (its pod stays ``Running``), so this only gates replicas the backend reports as not alive.
    """
    if restart_count <= 0:
        return 0.0
    base = float(getattr(settings, "FERRY_RESTART_BACKOFF_S", 10.0))
    cap = float(getattr(settings, "FERRY_RESTART_BACKOFF_MAX_S", 300.0))
    return min(base * 2 ** min(restart_count - 1, 30), cap)


def replica_failure(replica: ObservedReplica) -> str:
    """``replica X is not running (exit code C)[: termination message]`` — the words of Actions and rollouts."""
    text = f"replica {replica.name} is not running (exit code {replica.exit_code})"
    return f"{text}: {replica.message}" if replica.message else text


def pool_busy(pool: Pool) -> bool:
    """Whether an Action on ``pool`` is pending or running: one holding the pool lock (``Action.pool``), or a
    track Action (:mod:`apps.operations.tracks`: target ``pool``, no lock) that is still converging a track.

    Reconcile acts only on an idle pool: while a rollout's ``pool.track_delete`` stops a track's replicas, the
    backend still shows them, and a ``pool.apply`` for that "not desired" track would race it."""
    return pool.pk in pools_busy([pool.pk])


def pools_busy(pool_ids: list[int]) -> set[int]:
    """The ids among ``pool_ids`` that :func:`pool_busy` calls busy, in one query."""
    if not pool_ids:
        return set()
    rows = (Action.objects.filter(status__in=Action.ACTIVE_STATUSES)
            .filter(Q(pool_id__in=pool_ids) | Q(target_type="pool", target_id__in=[str(p) for p in pool_ids]))
            .values_list("pool_id", "target_type", "target_id"))
    wanted = set(pool_ids)
    busy: set[int] = set()
    for pool_id, target_type, target_id in rows:
        if pool_id in wanted:
            busy.add(pool_id)
        if target_type == "pool" and target_id.isdigit() and int(target_id) in wanted:
            busy.add(int(target_id))
    return busy


@dataclass
class _TickReads:
    """What :func:`pool_converge` reads besides the pool and its observation, read for many pools at once.

    ``busy``: pools with an active Action (:func:`pools_busy`). ``ejection_records``: a pool's telemetry
    records of the last ``FERRY_EJECTION_RESTART_WINDOW_S`` (absent: read on demand; ``None``: the read
    failed). ``restarted_at``: ``(pool id, replica) -> Unix seconds`` of its latest ``pool.restart_replica``
    Action within that window (older ones cannot exclude any record of the window).
    """

    busy: set[int]
    history: SignalHistory | None = None
    ejection_records: dict[int, list[dict] | None] = field(default_factory=dict)
    restarted_at: dict[tuple[int, str], float] | None = None

    @classmethod
    def read(cls, pools: list[tuple[Pool, ObservedState]], *, history: SignalHistory | None = None,
             now_s: float | None = None) -> _TickReads:
        """Everything for ``pools``: one Action query for busy pools, and for the idle ones with alive replicas
        one Redis round trip for their ejection records and one query for their recent restarts."""
        now_s = time.time() if now_s is None else now_s
        reads = cls(busy=pools_busy([pool.pk for pool, _ in pools]), history=history)
        window_s = settings.FERRY_EJECTION_RESTART_WINDOW_S
        candidates = [pool.pk for pool, observed in pools if pool.pk not in reads.busy and any(
            r.alive for t in observed.tracks.values() for r in t.replicas)]
        if not candidates:
            reads.restarted_at = {}
            return reads
        try:
            reads.ejection_records.update(telemetry_histories(pool_ids=candidates, since_s=now_s - window_s,
                                                              history=history))
        except redis.RedisError as exc:
            logger.warning("%d pools: no telemetry for ejections: %s", len(candidates), exc)
            reads.ejection_records.update(dict.fromkeys(candidates))
        reads.restarted_at = _restarted_at(candidates, since=now_s - window_s)
        return reads

    def records(self, pool: Pool, *, now_s: float) -> list[dict] | None:
        if pool.pk not in self.ejection_records:
            try:
                self.ejection_records[pool.pk] = telemetry_history(
                    pool_id=pool.pk, since_s=now_s - settings.FERRY_EJECTION_RESTART_WINDOW_S, history=self.history)
            except redis.RedisError as exc:
                logger.warning("pool %s: no telemetry for ejections: %s", pool, exc)
                self.ejection_records[pool.pk] = None
        return self.ejection_records[pool.pk]

    def restarts(self, pool: Pool, *, now_s: float) -> dict[str, float]:
        if self.restarted_at is None:
            self.restarted_at = _restarted_at([pool.pk], since=now_s - settings.FERRY_EJECTION_RESTART_WINDOW_S)
        return {name: at for (pool_id, name), at in self.restarted_at.items() if pool_id == pool.pk}


def _restarted_at(pool_ids: list[int], *, since: float) -> dict[tuple[int, str], float]:
    restarts = Action.objects.filter(pool_id__in=pool_ids, kind=POOL_RESTART_REPLICA,
                                     created_at__gte=datetime.fromtimestamp(since, tz=UTC))
    out: dict[tuple[int, str], float] = {}
    for pool_id, name, created in restarts.values_list("pool_id", "params__replica", "created_at"):
        if isinstance(name, str):
            out[(pool_id, name)] = max(out.get((pool_id, name), 0.0), created.timestamp())
    return out


def pool_converge(pool: Pool, observed: ObservedState, *, now_s: float | None = None,
                  reads: _TickReads | None = None) -> str | None:
    """Request the Action that moves ``pool`` toward its desired state; returns its kind or None (also when the
    pool is busy, :func:`pool_busy`).

    ``now_s`` (Unix seconds, default now) decides whether a dead replica's restart backoff is over. ``reads``:
    what a tick read for all its pools at once (default: read for this pool alone).
    """
    if reads is None:
        reads = _TickReads(busy=pools_busy([pool.pk]))
    if pool.pk in reads.busy:
        return None
    drift = pool_drift(pool, observed)
    if drift:
        desired = {t.name: [t.replicas, t.model_version.version] for t in pool.tracks.all()}
        reason = "; ".join(f"{name}: {why}" for name, why in sorted(drift.items()))
        created = _create(pool, POOL_APPLY, {"reason": reason}, _key(pool, "apply", desired), reason)
        return POOL_APPLY if created else None
    now_s = time.time() if now_s is None else now_s
    dead = sorted((r for t in observed.tracks.values() for r in t.replicas if not r.alive), key=lambda r: r.name)
    due = [r for r in dead
           if r.exited_at is None or now_s - r.exited_at >= restart_backoff_s(r.restart_count)]
    for replica in dead:
        if replica not in due:
            logger.info("pool %s: %s; restart %d in backoff until %.0fs after its death", pool,
                        replica_failure(replica), replica.restart_count + 1, restart_backoff_s(replica.restart_count))
    if due:
        replica = due[0]
        reason = replica_failure(replica)
        if replica.restart_count:
            reason += (f"; restart {replica.restart_count + 1} after a backoff of "
                       f"{restart_backoff_s(replica.restart_count):g}s")
        key = _key(pool, "restart", [replica.name, replica.restart_count])
        created = _create(pool, POOL_RESTART_REPLICA, {"replica": replica.name, "reason": reason}, key, reason)
        return POOL_RESTART_REPLICA if created else None
    return _restart_ejected(pool, observed, reads)


def replicas_ejected_repeatedly(records: Iterable[dict], *, since_s: dict[str, float], limit: int) -> dict[str, int]:
    """Replicas ejected at least ``limit`` times, from telemetry records (oldest first; each record's
    ``ejections`` maps a replica to the routers' ejection counter and ``at`` is Unix seconds).

    A replica's ejections are the counter's increases between consecutive records that both lie after
    ``since_s[replica]`` (its last restart; absent: every record counts); a decrease is a router restart and
    counts the new value (Prometheus' counter-reset rule). Returns replica -> ejections counted.
    """
    last: dict[str, float] = {}
    counted: dict[str, int] = {}
    for record in records:
        at = record.get("at", 0.0)
        for name, value in (record.get("ejections") or {}).items():
            if at <= since_s.get(name, float("-inf")):
                continue
            if name in last:
                counted[name] = counted.get(name, 0) + round(value - last[name] if value >= last[name] else value)
            last[name] = value
    return {name: n for name, n in counted.items() if n >= limit}


def _restart_ejected(pool: Pool, observed: ObservedState, reads: _TickReads) -> str | None:
    """A ``pool.restart_replica`` Action for the first alive replica the routers keep ejecting, if any."""
    alive = {r.name: r for t in observed.tracks.values() for r in t.replicas if r.alive}
    if not alive:
        return None
    now = time.time()
    records = reads.records(pool, now_s=now)
    if records is None:
        return None
    since = {name: at for name, at in reads.restarts(pool, now_s=now).items() if name in alive}
    ejected = replicas_ejected_repeatedly(records, since_s=since, limit=settings.FERRY_EJECTIONS_BEFORE_RESTART)
    for name in sorted(n for n in ejected if n in alive):
        reason = (f"replica {name} was ejected {ejected[name]} times by the router's circuit breaker in the last "
                  f"{settings.FERRY_EJECTION_RESTART_WINDOW_S} s")
        key = _key(pool, "restart-ejected", [name, alive[name].restart_count])
        created = _create(pool, POOL_RESTART_REPLICA, {"replica": name, "reason": reason}, key, reason)
        return POOL_RESTART_REPLICA if created else None
    return None


def reconcile_all(*, history: SignalHistory | None = None) -> ReconcileResult:
    """One reconcile tick over every pool (see the module docstring); ``history``: the telemetry the ejection
    check reads (default: :class:`SignalHistory` under its default prefix).

    The database work is batched so its statement count does not grow with the number of pools: the pools with
    their tracks (3 queries), the observed replicas of every reachable pool (:func:`replicas_refresh_many`), the
    busy pools, recent restarts and the ejection records (:class:`_TickReads`), cluster statuses (one update per
    status that changed), then one query per Action created and the routing table.
    """
    result = ReconcileResult()
    taken = services.action_leases_take_over()
    stale = [i for i in services.action_pending_stale(older_than_s=settings.FERRY_ACTION_REQUEUE_S) if i not in taken]
    for action_id in [*taken, *stale]:
        services.action_enqueue(action_id=action_id)
    result.taken_over, result.requeued = len(taken), len(stale)

    pools = Pool.objects.select_related("cluster").prefetch_related("tracks__model_version").order_by("cluster_id", "id")
    by_cluster: dict[int, list[Pool]] = {}
    for pool in pools:
        by_cluster.setdefault(pool.cluster_id, []).append(pool)
    seen: list[tuple[Pool, ObservedState]] = []
    statuses: dict[str, list[int]] = {}
    for cluster_pools in by_cluster.values():
        cluster = cluster_pools[0].cluster
        try:
            backend = backend_for_cluster(cluster)
        except BackendError as exc:
            logger.warning("cluster %s: no backend: %s", cluster, exc)
            result.pools_unreachable += len(cluster_pools)
            continue
        try:
            reachable = True
            for pool in cluster_pools:
                try:
                    observed = backend.observe(pool_ref(pool))
                except BackendUnavailable as exc:
                    logger.warning("pool %s: backend unavailable: %s", pool, exc)
                    result.pools_unreachable += 1
                    reachable = False
                    continue
                except BackendError as exc:
                    logger.warning("pool %s: cannot observe: %s", pool, exc)
                    result.pools_unreachable += 1
                    continue
                result.pools_observed += 1
                seen.append((pool, observed))
            status = Cluster.Status.READY if reachable else Cluster.Status.UNREACHABLE
            if cluster.status != status:
                statuses.setdefault(status, []).append(cluster.pk)
        finally:
            close_backend(backend)
    for status, cluster_ids in statuses.items():
        Cluster.objects.filter(pk__in=cluster_ids).update(status=status)
    replicas_refresh_many(observed={pool.pk: observed for pool, observed in seen})
    reads = _TickReads.read(seen, history=history)
    for pool, observed in seen:
        kind = pool_converge(pool, observed, reads=reads)
        result.applies += kind == POOL_APPLY
        result.restarts += kind == POOL_RESTART_REPLICA
    table, changed = routing_table_publish()
    result.routing_table_version, result.routing_table_changed = table.version, changed
    return result
