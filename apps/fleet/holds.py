"""Holds on a pool: checks, registered by the apps above fleet, that refuse moving or deleting a pool.

A pool that an active rollout includes must keep its model version and cluster and must not be
deleted until the rollout finishes or is aborted. Fleet sits below rollouts (``apps/__init__.py``,
"Layers") and cannot ask it, so the rollouts app registers its check here at startup
(``apps.rollouts.apps.RolloutsConfig.ready``) and fleet's services and the pool admin/API ask
:func:`pool_hold_reason`. A check returns a short reason ("an active rollout") or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable

from apps.fleet.models import Pool

PoolHoldCheck = Callable[[Pool], str | None]

_checks: dict[str, PoolHoldCheck] = {}


def pool_hold_register(name: str, check: PoolHoldCheck) -> None:
    """Register (or replace) the check ``name``; registering the same name twice keeps one check."""
    _checks[name] = check


def pool_hold_reason(pool: Pool) -> str | None:
    """The reason the first registered check gives for holding ``pool``, or ``None`` when none holds it."""
    for check in _checks.values():
        reason = check(pool)
        if reason is not None:
            return reason
    return None
