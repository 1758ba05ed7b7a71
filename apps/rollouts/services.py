"""Writes for rollout plans: create, update and delete (pending plans only for changes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from apps.catalog.models import ModelVersion
from apps.core.errors import ConflictError
from apps.fleet.models import Pool
from apps.rollouts.models import RolloutPlan
from apps.rollouts.selectors import rollout_active_for_pool


def rollout_plan_validate_pools(*, pools: list[Pool], target: ModelVersion, plan_id: int | None) -> None:
    """Check a plan's pools against its target (read-only; the admin form calls it too).

    Raises:
        ValidationError: no pools, pools on different stable versions, target already running,
            or prefill pools without decode pools (or the reverse).
        ConflictError: a pool is in another active rollout.
    """
    if not pools:
        raise ValidationError({"pools": ["A rollout needs at least one pool."]})
    versions = {p.model_version_id for p in pools}
    if len(versions) != 1:
        raise ValidationError({"pools": ["All pools must currently run the same stable model version."]})
    if target.pk in versions:
        raise ValidationError({"target_model_version": ["The pools already run this version."]})
    roles = {p.role for p in pools}
    if (Pool.Role.PREFILL in roles) != (Pool.Role.DECODE in roles):
        raise ValidationError({"pools": [
            "Prefill and decode pools roll out together (KV is only valid between identical weights): "
            "include both the prefill and the decode pool."
        ]})
    for pool in pools:
        other = rollout_active_for_pool(pool=pool, exclude_id=plan_id)
        if other is not None:
            raise ConflictError(f"Pool {pool} is already in rollout {other.name!r} ({other.state}).")


def rollout_plan_create(
    *, pools: Iterable[Pool], target_model_version: ModelVersion, created_by: AbstractBaseUser | None = None,
    **fields: Any,
) -> RolloutPlan:
    """Create a pending plan.

    Raises:
        ValidationError: invalid steps/gates/fields, pools on different versions, target already
            running, or a prefill pool without a decode pool (and vice versa).
        ConflictError: a pool is already in an active rollout.
    """
    pools = list(pools)
    plan = RolloutPlan(target_model_version=target_model_version, created_by=created_by, **fields)
    plan.full_clean()
    with transaction.atomic():
        rollout_plan_validate_pools(pools=pools, target=target_model_version, plan_id=None)
        plan.save()
        plan.pools.set(pools)
    return plan


def rollout_plan_update(*, plan: RolloutPlan, pools: Iterable[Pool] | None = None, **changes: Any) -> RolloutPlan:
    """Change a pending plan. Raises ConflictError once it has started; ValidationError as for create."""
    if plan.state != RolloutPlan.State.PENDING:
        raise ConflictError(f"Rollout {plan.name!r} is {plan.state}; only pending plans can be changed.")
    for field, value in changes.items():
        setattr(plan, field, value)
    plan.full_clean()
    new_pools = list(pools) if pools is not None else list(plan.pools.all())
    with transaction.atomic():
        rollout_plan_validate_pools(pools=new_pools, target=plan.target_model_version, plan_id=plan.pk)
        plan.save()
        if pools is not None:
            plan.pools.set(new_pools)
    return plan


def rollout_plan_delete(*, plan: RolloutPlan) -> None:
    """Delete a plan that is pending or finished. Raises ConflictError while it is progressing or paused."""
    if plan.state in (RolloutPlan.State.PROGRESSING, RolloutPlan.State.PAUSED):
        raise ConflictError(f"Rollout {plan.name!r} is {plan.state}; abort it before deleting.")
    with transaction.atomic():
        plan.delete()
