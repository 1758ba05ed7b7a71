"""Replica and weight arithmetic of a canary (pure functions, no Django).

**Split** for a canary weight ``W`` (percent) on a pool of ``R`` replicas (Argo Rollouts' replica
arithmetic without a traffic router): ``canary = ceil(R * W / 100)`` for ``W > 0`` (0 for ``W = 0``),
``stable = R - canary``. **The R=1 rule** (and generally when ``canary == R`` while ``W < 100``):
the stable track keeps one replica so the ``100 - W`` percent still sent to it has somewhere to go,
and the canary is a surge replica: ``R=1, W=10 -> canary 1 + stable 1`` (total 2). That needs
``max_surge >= 1``; with ``max_surge = 0`` such a step is refused (:class:`ReplicaMathError`).

**Moving** from the current desired counts to a split never exceeds ``R + max_surge`` desired
replicas in total and never drops the ready replicas below ``R`` (:func:`next_replicas`, Kubernetes'
``maxSurge`` / ``maxUnavailable = 0``); with ``max_surge = 0`` one replica at a time is removed
first (``maxUnavailable = 1``), as Kubernetes does when both would otherwise be zero.

**Weight** actually applied (:func:`applied_weight`): a track with zero ready replicas gets no
traffic; while the canaries come up the weight is ``W`` scaled by the slowest pool's ready/target
canary ratio plus the allowed prefill/decode skew, and reaches ``W`` when every pool is ready.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


class ReplicaMathError(ValueError):
    """A weight that cannot be served with these replicas and surge; the message says how to fix it."""


def canary_split(total: int, weight: int, *, max_surge: int) -> tuple[int, int]:
    """``(canary, stable)`` desired replicas for ``weight`` percent on ``total`` replicas (module docstring).

    Examples: ``(3, 33) -> (1, 2)``, ``(10, 50) -> (5, 5)``, ``(1, 10) -> (1, 1)`` (surge one canary),
    ``(4, 100) -> (4, 0)``, ``(4, 0) -> (0, 4)``.

    Raises:
        ReplicaMathError: total < 0, weight outside 0..100, or a weight below 100 that would leave
            the stable track without replicas while ``max_surge`` is 0.
    """
    if total < 0 or not 0 <= weight <= 100 or max_surge < 0:
        raise ReplicaMathError(f"need total >= 0, weight in 0..100 and max_surge >= 0; got {total}, {weight}, "
                               f"{max_surge}")
    canary = math.ceil(total * weight / 100) if weight > 0 else 0
    stable = total - canary
    if weight < 100 and stable == 0 and total > 0:
        if max_surge < 1:
            raise ReplicaMathError(
                f"weight {weight}% on {total} replica(s) needs {canary} canary replica(s), leaving none for the "
                f"{100 - weight}% of traffic that stays on stable; set max_surge >= 1 (one extra stable replica) "
                "or use weight 100.")
        stable = 1
    return canary, stable


def next_replicas(*, desired: Mapping[str, int], ready: Mapping[str, int], target: Mapping[str, int],
                  total: int, max_surge: int) -> dict[str, int]:
    """One move of the desired replicas toward ``target`` (tracks by name) under the surge limit.

    Tracks below target grow into the room ``total + max_surge - sum(desired)``;
    tracks above target first lose their replicas that are not ready (they serve nothing: a canary that
    never becomes ready must still go to 0), then shrink by the ready replicas in excess of
    ``min(total, sum(target))`` (so ready capacity never falls below it). With ``max_surge = 0`` and no other move possible, one replica of
    the first shrinking track is removed. Call again as replicas become ready; it returns
    ``desired`` unchanged when nothing can move yet.

    Raises:
        ReplicaMathError: negative counts, or target/desired name different tracks.
    """
    if set(desired) != set(target):
        raise ReplicaMathError(f"desired tracks {sorted(desired)} differ from target tracks {sorted(target)}")
    if any(v < 0 for v in (*desired.values(), *target.values(), total, max_surge)):
        raise ReplicaMathError("replica counts, total and max_surge must be >= 0")
    out = dict(desired)
    ceiling = total + max_surge
    for name in sorted(out):
        if out[name] < target[name]:
            room = ceiling - sum(out.values())
            out[name] = min(target[name], out[name] + max(room, 0))
    ready_now = sum(min(ready.get(name, 0), desired[name]) for name in desired)
    excess = ready_now - min(total, sum(target.values()))
    grew = out != dict(desired)
    for name in sorted(out):
        unready = desired[name] - min(ready.get(name, 0), desired[name])
        if out[name] > target[name] and unready > 0:  # serves nothing: the first to go, whatever else is ready
            out[name] -= min(out[name] - target[name], unready)
        if out[name] > target[name] and excess > 0:
            cut = min(out[name] - target[name], excess)
            out[name] -= cut
            excess -= cut
    if out == dict(desired) and not grew and max_surge == 0:
        for name in sorted(out):
            if out[name] > target[name]:
                out[name] -= 1
                break
    return out


def applied_weight(*, weight: int, previous: int, shares: Mapping[str, tuple[int, int]], skew: int,
                   serving_ready: int) -> int:
    """The canary weight to publish now, for a target ``weight`` (percent).

    ``shares``: pool name -> ``(ready canary replicas, canary target)``; ``serving_ready``: ready
    canary replicas in the pools that serve requests (decode/colocated). Rules, in order: no ready
    serving canary -> 0; a decrease applies at once; every pool at its target -> ``weight``;
    otherwise ``min(weight, floor(weight * r) + skew)`` with ``r`` the smallest ready/target ratio
    over the pools (the slowest pool sets the pace; prefill and decode stay within ``skew``
    points), but never below ``previous`` when that is still ``<= weight`` (a rising weight does
    not fall back while replicas come up).
    """
    if weight == 0 or serving_ready == 0:
        return 0
    if weight <= previous:
        return weight
    if all(target == 0 or ready >= target for ready, target in shares.values()):
        return weight
    paced = min(weight * min(ready, target) // target for ready, target in shares.values() if target)
    return max(min(weight, paced + skew), min(previous, weight))
