"""Handlers of the pool Action kinds: ``pool.scale``, ``pool.apply``, ``pool.restart_replica``, ``pool.delete``,
``pool.flush_kv_cache``.

``pool.scale`` changes the tracks only through :mod:`apps.operations.tracks` (one ``pool.track_set`` Action per
track change); the other handlers write no desired state. Every handler is idempotent — running it again (a Celery retry, or reconcile taking over an
expired lease) converges to the same final state and writes nothing the second time: desired
state is set to absolute values, and the backend verbs are idempotent (a scale to the current
count patches nothing). Scale and apply wait until the backend reports the desired replicas
ready (``FERRY_ACTION_READY_TIMEOUT_S``); the executor's heartbeat keeps the lease meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import httpx
from django.conf import settings

from apps.fleet.models import Cluster, Pool, PoolTrack
from apps.operations import services, tracks
from apps.operations.backends import backend_session, pool_ref, track_spec
from apps.operations.handlers import ActionError, register
from apps.operations.models import Action
from apps.orchestrators.base import BackendUnavailable, ObservedState, OrchestratorBackend, PoolRef
from inference_worker import http_headers
from inference_worker.server.signing import sign

POOL_SCALE = "pool.scale"
POOL_APPLY = "pool.apply"
POOL_RESTART_REPLICA = "pool.restart_replica"
POOL_DELETE = "pool.delete"
POOL_FLUSH_KV_CACHE = "pool.flush_kv_cache"
KV_CACHE_RESET_PATH = "/admin/kv-cache/reset"
"""The worker's authenticated prefix-cache reset (``inference_worker/server/kv_cache_routes.py``)."""
KV_CACHE_RESET_TIMEOUT_S = 30.0


def _converged(observed: ObservedState, expected: Mapping[str, int]) -> bool:
    for track, replicas in expected.items():
        seen = observed.tracks.get(track)
        if seen is None:
            if replicas:
                return False
            continue
        alive = sum(1 for r in seen.replicas if r.alive)
        if seen.desired_replicas != replicas or seen.ready_replicas != replicas or (seen.replicas and alive != replicas):
            return False
    return True


def _describe(observed: ObservedState) -> str:
    return ", ".join(f"{name}: {t.ready_replicas}/{t.desired_replicas} ready"
                     for name, t in sorted(observed.tracks.items())) or "no tracks"


def wait_ready(backend: OrchestratorBackend, ref: PoolRef, expected: Mapping[str, int], *,
               timeout_s: float | None = None, poll_s: float = 0.5, first_poll_s: float = 0.05) -> ObservedState:
    """Poll ``observe`` until every track in ``expected`` has exactly that many ready replicas.

    The pause between two polls starts at ``first_poll_s`` and doubles up to ``poll_s``: a change the
    backend makes in a few tens of milliseconds (a scale down, an emulated cluster) ends the Action then,
    not half a second later, while a long wait (a model loading) still polls every ``poll_s``. The pauses
    never run past the deadline.

    Raises:
        ActionError: (retryable) not converged within ``timeout_s`` (default FERRY_ACTION_READY_TIMEOUT_S).
        BackendError: from ``observe``.
    """
    timeout_s = settings.FERRY_ACTION_READY_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    pause_s = min(first_poll_s, poll_s)
    while True:
        observed = backend.observe(ref)
        if _converged(observed, expected):
            return observed
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise ActionError(f"not ready after {timeout_s:.0f}s: {_describe(observed)} "
                              f"(wanted {dict(expected)})", retryable=True)
        time.sleep(min(pause_s, left_s))
        pause_s = min(pause_s * 2, poll_s)


def _locked_pool(action: Action) -> Pool:
    if action.pool_id is None:
        raise ActionError(f"{action.kind} needs a pool, and action #{action.pk} has none (was it deleted?)")
    return Pool.objects.select_related("cluster").get(pk=action.pool_id)


def _tracks(pool: Pool) -> list[PoolTrack]:
    return list(pool.tracks.select_related("model_version").order_by("name"))


@register(POOL_SCALE)
def pool_scale_handler(action: Action) -> None:
    """Set the pool's total replicas through :func:`apps.operations.tracks.pool_total_set` (one ``pool.track_set``
    Action per track whose count changes, requested by who asked for the scale), run those Actions once the
    tracks are committed (their handlers call the backend), and wait until every track is ready.

    A track whose row already holds its share gets no Action (no change) but is still scaled in the backend
    (:func:`apps.operations.tracks.track_scale`, a no-op there when the count matches; a never-applied track is
    applied), as before. A re-run (a retry, or reconcile taking over an expired lease) records nothing new: the
    rows already hold the split. It runs the scale's track Actions still pending, then waits again.
    """
    replicas = action.params.get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ActionError(f"params.replicas must be a non-negative integer, got {replicas!r}")
    pool = _locked_pool(action)
    key = f"pool.scale-{action.pk}"
    try:
        split, recorded = tracks.pool_total_set(pool=pool, replicas=replicas, idempotency_key=key,
                                                requester=services.action_requester(action),
                                                requested_by=action.requested_by)
    except ValueError as exc:
        raise ActionError(f"pool {pool} has no tracks to scale") from exc
    desired = ", ".join(f"{name}={n}" for name, n in sorted(split.items()))
    services.action_log_append(action_id=action.pk, message=f"desired replicas {desired}"
                               + ("" if recorded else " (already recorded)"))
    pending = Action.objects.filter(idempotency_key__startswith=f"{key}:", status=Action.Status.PENDING)
    outcomes = tracks.actions_execute(action_ids=list(pending.order_by("id").values_list("pk", flat=True)))
    if "retry-later" in outcomes.values():
        raise BackendUnavailable(f"track actions {sorted(i for i, o in outcomes.items() if o == 'retry-later')} "
                                 "could not reach the backend; they stay pending")
    failed = Action.objects.filter(pk__in=[i for i, o in outcomes.items() if o == "failed"]).order_by("id")
    if failed:
        raise ActionError("; ".join(f"action #{a.pk} ({a.params.get('track')}): {a.error}" for a in failed))
    changed = set(Action.objects.filter(idempotency_key__startswith=f"{key}:").values_list("params__track", flat=True))
    with backend_session(pool.cluster) as backend:
        for track in _tracks(pool):
            if track.name not in changed:  # its row already held the split: the backend may not (never applied)
                tracks.track_scale(backend, pool, track)
        observed = wait_ready(backend, pool_ref(pool), split)
    services.action_log_append(action_id=action.pk, message=f"ready: {_describe(observed)}")


@register(POOL_APPLY)
def pool_apply_handler(action: Action) -> None:
    """Apply every desired track with its full spec, delete tracks not desired, wait until ready."""
    pool = _locked_pool(action)
    desired = _tracks(pool)
    ref = pool_ref(pool)
    with backend_session(pool.cluster) as backend:
        for track in desired:
            backend.apply_pool_track(track_spec(pool, track))
        wanted = {t.name for t in desired}
        for name in sorted(set(backend.observe(ref).tracks) - wanted):
            backend.delete_track(ref, name)
            services.action_log_append(action_id=action.pk, message=f"deleted track {name} (not desired)")
        observed = wait_ready(backend, ref, {t.name: t.replicas for t in desired})
    services.action_log_append(action_id=action.pk, message=f"applied; ready: {_describe(observed)}")


@register(POOL_RESTART_REPLICA)
def pool_restart_replica_handler(action: Action) -> None:
    """Restart one replica by its backend name (``params.replica``)."""
    name = action.params.get("replica")
    if not isinstance(name, str) or not name:
        raise ActionError(f"params.replica must be a replica name, got {name!r}")
    pool = _locked_pool(action)
    with backend_session(pool.cluster) as backend:
        backend.restart_replica(pool_ref(pool), name)
    services.action_log_append(action_id=action.pk, message=f"restarted {name}")


@register(POOL_DELETE)
def pool_delete_handler(action: Action) -> None:
    """Remove a deleted pool's tracks from its backend (params carry what the deleted row held)."""
    params = action.params
    try:
        cluster = Cluster.objects.get(pk=params["cluster_id"])
        ref = PoolRef(pool_id=int(params["pool_id"]), pool_name=params["pool_name"],
                      namespace=params.get("namespace") or "default")
    except (KeyError, TypeError, ValueError, Cluster.DoesNotExist) as exc:
        raise ActionError(f"pool.delete params are incomplete or the cluster is gone: {exc!r}") from exc
    with backend_session(cluster) as backend:
        names = set(params.get("tracks", [])) | set(backend.observe(ref).tracks)
        for name in sorted(names):
            backend.delete_track(ref, name)
    services.action_log_append(action_id=action.pk, message=f"deleted tracks {sorted(names)}")


@register(POOL_FLUSH_KV_CACHE)
def pool_flush_kv_cache_handler(action: Action) -> None:
    """Flush the prefix cache of every running replica of the pool: its backend's observed replicas (the agent's
    processes or the pods), each sent the worker's ``POST /admin/kv-cache/reset`` with the pool's worker token
    (``Authorization: Bearer``; on a 401 the token before the pool's last rotation, once: that replica has not
    rolled yet) and, when the control plane has ``FERRY_KV_LINK_SECRET``, also signed with it (HMAC-SHA256 of the
    body, 64 hex digits), which a worker started without a worker token checks instead.

    Idempotent: a flushed cache flushed again stays empty. Every replica is tried; the ones that failed are named
    in the error with their reason (HTTP status and the worker's message, a 200 whose body has no ``cleared_blocks``
    (something else answering at the endpoint), a bad endpoint URL or the connection error) and the Action is
    retryable: a retry flushes every replica again.

    Raises:
        ActionError: no running replica or a replica failed (retryable).
        BackendError: from ``observe``.
    """
    secret = settings.FERRY_KV_LINK_SECRET
    pool = _locked_pool(action)
    with backend_session(pool.cluster) as backend:
        observed = backend.observe(pool_ref(pool))
    replicas = sorted((r for t in observed.tracks.values() for r in t.replicas if r.alive and r.endpoint),
                      key=lambda r: r.name)
    if not replicas:
        raise ActionError(f"pool {pool} has no running replica to flush ({_describe(observed)})", retryable=True)
    body = b"{}"
    headers = {"content-type": "application/json"}
    if secret:
        headers[http_headers.KV_SIGNATURE] = sign(secret.encode(), body)
    tokens = [t for t in (pool.worker_token, pool.worker_token_previous) if t]
    failures = []
    with httpx.Client(timeout=KV_CACHE_RESET_TIMEOUT_S) as client:
        for replica in replicas:
            try:
                for token in tokens or [""]:
                    auth = {"Authorization": f"Bearer {token}"} if token else {}
                    response = client.post(replica.endpoint.rstrip("/") + KV_CACHE_RESET_PATH, content=body,
                                           headers={**headers, **auth})
                    if response.status_code != 401:
                        break
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                failures.append(f"{replica.name}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code != 200:
                failures.append(f"{replica.name}: HTTP {response.status_code}: {response.text[:300]}")
                continue
            try:  # something other than a worker may answer at the endpoint: that replica fails, the rest go on
                cleared = response.json()["cleared_blocks"]
            except (ValueError, TypeError, KeyError):
                failures.append(f"{replica.name}: HTTP 200 without cleared_blocks: {response.text[:300]!r}")
                continue
            services.action_log_append(action_id=action.pk, message=f"flushed {replica.name}: {cleared} blocks cleared")
    if failures:
        raise ActionError(f"KV cache flush failed on {len(failures)} of {len(replicas)} replicas: "
                          + "; ".join(failures), retryable=True)
