"""``rollout.state`` messages: every committed change of a rollout plan goes to its Channels group.

The rollout page (``ws/rollouts/<id>/``, :class:`apps.dashboard.consumers.RolloutConsumer`) joins
:func:`rollout_group` and re-reads the plan when such a message arrives, so a verb, a step, an abort or the end of
a cleanup shows at once rather than at the page's next poll. Messages go through the one telemetry helper
(:func:`apps.telemetry.broadcast.telemetry_broadcast`: a ``seq`` per group) after the transaction that saved the
plan commits; a channel layer or Redis that is down costs the message (logged), never the rollout's change.
"""

from __future__ import annotations

import logging

from django.db import transaction
from redis.exceptions import RedisError

from apps.rollouts.models import RolloutPlan
from apps.telemetry.broadcast import telemetry_broadcast
from apps.telemetry.history import SignalHistory

logger = logging.getLogger(__name__)

ROLLOUT_STATE = "rollout.state"


def rollout_group(rollout_id: int | str) -> str:
    """The Channels group of one rollout (``rollout.<id>``)."""
    return f"rollout.{rollout_id}"


def rollout_state_payload(plan: RolloutPlan) -> dict:
    """What a ``rollout.state`` message says about ``plan`` (besides ``type`` and ``seq``)."""
    return {"rollout_id": plan.pk, "state": plan.state, "phase": plan.phase, "message": plan.message,
            "current_step_index": plan.current_step_index}


def rollout_state_broadcast(payload: dict) -> None:
    """Send one ``rollout.state`` message to the rollout's group now (call after commit)."""
    try:
        telemetry_broadcast(rollout_group(payload["rollout_id"]), ROLLOUT_STATE, payload, history=SignalHistory())
    except (RuntimeError, RedisError, OSError) as exc:
        logger.warning("rollout %s: rollout.state not sent: %s", payload["rollout_id"], exc)


def rollout_saved(sender: type, instance: RolloutPlan, **kwargs: object) -> None:
    """``post_save`` receiver: broadcast the plan as saved once the transaction commits."""
    payload = rollout_state_payload(instance)
    transaction.on_commit(lambda: rollout_state_broadcast(payload))
