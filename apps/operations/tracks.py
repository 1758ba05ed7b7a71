"""Every write of a pool's tracks (its desired state, DESIGN.md "Desired state"): one service per change, one
``Action`` per change, and no backend call inside the writer's transaction.

The operator's and the autoscaler's ``pool.scale`` (:func:`pool_total_set`, called by that Action's handler),
an operator's change of a pool's model version (:func:`apps.operations.pools.pool_update`) and the rollout
controller (which owns the split between tracks and their traffic weights while a rollout runs) all change
``PoolTrack`` rows only through these services. The one exception is a new pool's first ``stable`` track, which
:func:`apps.fleet.services.pool_create` writes with the pool row (no backend knows the pool yet; reconcile's
``pool.apply`` Action brings it up).

* :func:`pool_track_create` and :func:`pool_track_set` write one row and record one ``pool.track_set`` Action.
  A change that reaches the backend (a new track, ``replicas``, ``model_version``, ``extra_args``) leaves the
  Action pending: it is enqueued after commit, and its handler reads the row as it is then (absolute desired
  state, so a late, repeated or reordered run converges to the same thing) and calls ``apply_pool_track`` with
  the row's full spec (never ``scale_track`` alone: see :func:`pool_track_set_handler`). A change of ``weight`` or
  ``active`` alone reaches only the routing table, which the caller publishes: its Action is recorded as
  succeeded at once.
* :func:`pool_track_delete` deletes the row; its ``pool.track_delete`` Action calls ``delete_track`` unless a
  track of that name is desired again by then.
* :func:`pool_active_switch` records a ``pool.switch_active`` Action whose handler calls ``switch_active``
  (Kubernetes: the pool Service selects the track; local: the routing table does it).
* :func:`pool_total_set` splits a new total over the pool's tracks (:func:`split_replicas`) and calls
  :func:`pool_track_set` for each track whose count changes (the ``pool.scale`` handler, which then runs those
  Actions and :func:`track_scale` for the tracks whose count did not change).

These Actions carry no ``pool`` lock (``Action.pool`` is empty: a rollout changes several tracks of a pool in
one tick and must not be refused by, or block, the operator's one-action-per-pool lock, which the operator's
``pool.scale`` Action itself holds); their target is the pool (``target_type="pool"``) and
``params["requester"]`` says who asked: a user's name, ``autoscaler``, or ``rollout:7``. Every service takes an
``idempotency_key``: a second call with the same key returns the first Action and writes nothing. While one of
them is pending or running, reconcile leaves the pool alone (:func:`apps.operations.reconcile.pool_busy`), so it
never races a track Action with a ``pool.apply`` of its own.

The services never call a backend. The handlers run in the Action's execution (the Celery task enqueued on
commit), or through :func:`actions_execute` which a caller runs once its own transaction has committed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from apps.catalog.models import ModelVersion
from apps.fleet.models import Pool, PoolTrack
from apps.operations import services
from apps.operations.backends import backend_session, pool_ref, track_spec
from apps.operations.execution import RetryLater, action_execute
from apps.operations.handlers import ActionError, register
from apps.operations.models import Action
from apps.orchestrators.base import NotFound, OrchestratorBackend

logger = logging.getLogger(__name__)

POOL_TRACK_SET = "pool.track_set"
POOL_TRACK_DELETE = "pool.track_delete"
POOL_SWITCH_ACTIVE = "pool.switch_active"
BACKEND_FIELDS = ("replicas", "model_version", "extra_args")
"""``PoolTrack`` fields a backend runs (a change is applied by the Action's handler)."""
ROUTING_FIELDS = ("weight", "active")
"""``PoolTrack`` fields only the routing table carries (published by the caller)."""


def _value(track: PoolTrack, field: str) -> object:
    return track.model_version_id if field == "model_version" else getattr(track, field)


def _json(value: object) -> object:
    return value.version if isinstance(value, ModelVersion) else value


def _record(*, pool: Pool, track: str, kind: str, params: dict, requester: str, idempotency_key: str,
            reaches_backend: bool, requested_by: AbstractBaseUser | None = None) -> Action:
    """One Action on ``pool``: pending and enqueued after commit, or (routing only) succeeded at once."""
    params = {"track": track, **params, "requester": requester}
    target = {"target_type": "pool", "target_id": str(pool.pk), "target_repr": f"{pool} {track}"[:200],
              "requested_by": requested_by}
    if reaches_backend:
        action, _ = services.action_create(kind=kind, params=params, idempotency_key=idempotency_key,
                                           requester=requester, **target)
        return action
    existing = Action.objects.filter(idempotency_key=idempotency_key).first()
    if existing is not None:
        return existing
    now = timezone.now()
    log = [{"at": now.isoformat(), "message": f"requested by {requester}"},
           {"at": now.isoformat(), "message": "routing table only (weight/active): no backend call"}]
    return Action.objects.create(kind=kind, params=params, idempotency_key=idempotency_key, attempts=0,
                                 status=Action.Status.SUCCEEDED, started_at=now, finished_at=now, log=log, **target)


def pool_track_create(*, pool: Pool, name: str, model_version: ModelVersion, active: bool, requester: str,
                      idempotency_key: str, replicas: int = 0, weight: int = 0,
                      extra_args: str = "") -> tuple[PoolTrack, Action]:
    """Create track ``name`` of ``pool`` and record its ``pool.track_set`` Action (pending: the handler applies
    the track's spec to the backend). Returns ``(track, action)``.

    Raises:
        ConflictError: the idempotency key was used for a different request.
        IntegrityError: the pool already has a track of that name.
    """
    with transaction.atomic():
        track = PoolTrack.objects.create(pool=pool, name=name, model_version=model_version, replicas=replicas,
                                         weight=weight, active=active, extra_args=extra_args)
        changes = {"created": True, "replicas": replicas, "weight": weight, "active": active,
                   "model_version": model_version.version, "extra_args": extra_args}
        action = _record(pool=pool, track=name, kind=POOL_TRACK_SET, params={"changes": changes},
                         requester=requester, idempotency_key=idempotency_key, reaches_backend=True)
    return track, action


def pool_track_set(*, track: PoolTrack, requester: str, idempotency_key: str, replicas: int | None = None,
                   weight: int | None = None, active: bool | None = None, model_version: ModelVersion | None = None,
                   extra_args: str | None = None, requested_by: AbstractBaseUser | None = None) -> Action | None:
    """Set the given fields of ``track`` (``None``: unchanged); saves only changed fields and records one
    ``pool.track_set`` Action for them. Returns the Action, or None when nothing changed (no Action).

    ``track`` is updated in place. ``weight`` is percent (0..100), ``replicas`` a count. ``requested_by`` is the
    user behind ``requester`` (an operator), kept on the Action for the audit log.

    Raises:
        ConflictError: the idempotency key was used for a different request.
    """
    wanted = {"replicas": replicas, "weight": weight, "active": active, "model_version": model_version,
              "extra_args": extra_args}
    wanted = {f: v for f, v in wanted.items() if v is not None}
    changed = [f for f, v in wanted.items() if _value(track, f) != (v.pk if isinstance(v, ModelVersion) else v)]
    if not changed:
        return None
    with transaction.atomic():
        for field in changed:
            setattr(track, field, wanted[field])
        track.save(update_fields=changed)
        changes = {f: _json(wanted[f]) for f in changed}
        return _record(pool=track.pool, track=track.name, kind=POOL_TRACK_SET, params={"changes": changes},
                       requester=requester, idempotency_key=idempotency_key, requested_by=requested_by,
                       reaches_backend=any(f in BACKEND_FIELDS for f in changed))


def split_replicas(total: int, tracks: Sequence[PoolTrack]) -> dict[str, int]:
    """Split a pool's new ``total`` over its tracks in proportion to their current replicas.

    Falls back to the traffic weights when every track has 0 replicas, and to equal shares when
    those are 0 too. Largest remainder method (ties: track name order), so the parts sum to
    ``total`` exactly. The rollout controller re-splits during a rollout; outside one, the single
    ``stable`` track gets everything.

    Raises:
        ValueError: ``total`` < 0 or no tracks.
    """
    if total < 0 or not tracks:
        raise ValueError(f"cannot split {total} replicas over {len(tracks)} tracks")
    ordered = sorted(tracks, key=lambda t: t.name)
    shares = [t.replicas for t in ordered]
    if sum(shares) == 0:
        shares = [t.weight for t in ordered]
    if sum(shares) == 0:
        shares = [1] * len(ordered)
    exact = [total * s / sum(shares) for s in shares]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(ordered)), key=lambda i: (-(exact[i] - parts[i]), ordered[i].name))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return {t.name: n for t, n in zip(ordered, parts, strict=True)}


def pool_total_set(*, pool: Pool, replicas: int, requester: str, idempotency_key: str,
                   requested_by: AbstractBaseUser | None = None) -> tuple[dict[str, int], list[Action]]:
    """Set ``pool``'s total desired replicas: split it over the tracks (:func:`split_replicas`) and record one
    ``pool.track_set`` Action per track whose count changes (key ``<idempotency_key>:<track>:replicas-<n>``, so
    running this again for the same total records nothing new). Locks the pool row while it writes.

    Returns ``(split, actions)``: replicas per track name, and the Actions recorded now (none when the rows
    already hold the split).

    Raises:
        ValueError: ``replicas`` < 0 or the pool has no tracks.
        ConflictError: one of the derived keys was used for a different request.
    """
    with transaction.atomic():
        Pool.objects.select_for_update().filter(pk=pool.pk).first()  # one writer of the split at a time
        tracks = list(pool.tracks.select_related("pool", "model_version").order_by("name"))
        split = split_replicas(replicas, tracks)
        actions = [pool_track_set(track=t, replicas=split[t.name], requester=requester, requested_by=requested_by,
                                  idempotency_key=f"{idempotency_key}:{t.name}:replicas-{split[t.name]}")
                   for t in tracks]
    return split, [a for a in actions if a is not None]


def pool_track_delete(*, track: PoolTrack, requester: str, idempotency_key: str) -> Action:
    """Delete ``track``'s row and record the ``pool.track_delete`` Action that removes its backend objects.

    Raises:
        ConflictError: the idempotency key was used for a different request.
    """
    with transaction.atomic():
        pool, name = track.pool, track.name
        track.delete()
        return _record(pool=pool, track=name, kind=POOL_TRACK_DELETE, params={}, requester=requester,
                       idempotency_key=idempotency_key, reaches_backend=True)


def pool_active_switch(*, pool: Pool, track: str, requester: str, idempotency_key: str) -> Action:
    """Record the ``pool.switch_active`` Action that makes ``track`` the pool's active track in the backend.

    Raises:
        ConflictError: the idempotency key was used for a different request.
    """
    with transaction.atomic():
        return _record(pool=pool, track=track, kind=POOL_SWITCH_ACTIVE, params={}, requester=requester,
                       idempotency_key=idempotency_key, reaches_backend=True)


def actions_execute(*, action_ids: Iterable[int]) -> dict[int, str]:
    """Run pending Actions now, in this process (call it once the caller's transaction has committed).

    The Celery task enqueued on commit may run the same Action: the claim (a conditional update) lets one run
    it and the other return ``skipped``. A retryable backend failure leaves the Action pending with its backoff
    (reconcile enqueues it again). Returns ``{action_id: outcome}`` (``succeeded``, ``failed``, ``skipped``,
    ``retry-later``).
    """
    outcomes = {}
    for action_id in action_ids:
        try:
            outcomes[action_id] = action_execute(action_id=action_id)
        except RetryLater as exc:
            logger.warning("action %s: %s; left pending for a retry", action_id, exc.reason)
            outcomes[action_id] = "retry-later"
    return outcomes


def switch_outcome(action: Action) -> str:
    """What a succeeded ``pool.switch_active`` Action reported (``switch_active(green) -> routing_table``)."""
    return next((line["message"] for line in reversed(action.log)
                 if line["message"].startswith("switch_active(")), "switch_active done")


# --------------------------------------------------------------------------- handlers (the Action's execution)


def _pool(action: Action) -> Pool:
    pool = Pool.objects.select_related("cluster").filter(pk=action.target_id).first()
    if pool is None:
        raise ActionError(f"{action.kind}: pool {action.target_id} no longer exists")
    return pool


@register(POOL_TRACK_SET)
def pool_track_set_handler(action: Action) -> None:
    """Apply the track's current row, whole (``apply_pool_track``: replicas, model version, worker options).

    Never ``scale_track`` alone, even for a replicas-only change: the Actions of one track may run in any
    order (Celery, a retry, reconcile's requeue), and scaling a backend track whose version or options a
    later Action changes started replicas of the old spec (on Kubernetes: pods of the old template that the
    template change then had to roll). ``apply_pool_track`` is idempotent on both backends (an unchanged spec
    patches nothing and restarts nothing)."""
    pool, name = _pool(action), action.params.get("track", "")
    track = PoolTrack.objects.select_related("model_version").filter(pool=pool, name=name).first()
    if track is None:
        services.action_log_append(action_id=action.pk, message=f"track {name} is no longer desired: nothing to do")
        return
    with backend_session(pool.cluster) as backend:
        backend.apply_pool_track(track_spec(pool, track))
    services.action_log_append(action_id=action.pk,
                               message=f"applied {name} ({track.replicas} replicas, {track.model_version.version})")


def track_scale(backend: OrchestratorBackend, pool: Pool, track: PoolTrack) -> str:
    """Bring the backend's replica count of ``track`` to its row's: ``scale_track`` (a no-op when the backend
    already has that count), or ``apply_pool_track`` with the full spec when the track was never applied
    (``NotFound``). Call it from an Action's handler, never under a row lock. Returns what was done."""
    try:
        backend.scale_track(pool_ref(pool), track.name, track.replicas)
        return f"scaled {track.name} to {track.replicas}"
    except NotFound:  # never applied: create it with the full spec
        backend.apply_pool_track(track_spec(pool, track))
        return f"applied {track.name} ({track.replicas} replicas)"


@register(POOL_TRACK_DELETE)
def pool_track_delete_handler(action: Action) -> None:
    """``delete_track`` unless a track of that name is desired again (a later rollout created it)."""
    pool, name = _pool(action), action.params.get("track", "")
    if PoolTrack.objects.filter(pool=pool, name=name).exists():
        services.action_log_append(action_id=action.pk, message=f"track {name} is desired again: not deleted")
        return
    with backend_session(pool.cluster) as backend:
        backend.delete_track(pool_ref(pool), name)
    services.action_log_append(action_id=action.pk, message=f"deleted track {name}")


@register(POOL_SWITCH_ACTIVE)
def pool_switch_active_handler(action: Action) -> None:
    """``switch_active`` to ``params.track``; logs what the backend did."""
    pool, name = _pool(action), action.params.get("track", "")
    with backend_session(pool.cluster) as backend:
        how = backend.switch_active(pool_ref(pool), name)
    services.action_log_append(action_id=action.pk, message=f"switch_active({name}) -> {how}")
