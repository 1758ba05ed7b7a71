"""The rollout state machine in one place: which event moves a rollout from which state to which.

States (``RolloutPlan.State``)::

    pending --start--> progressing <--pause/resume--> paused
    progressing --(last step done, or promote)--> progressing/finalizing --complete--> promoted
    pending|progressing|paused --abort--> aborted        (traffic back to stable at once)
    progressing|paused --fail--> failed                  (progress deadline; traffic back to stable)
    promoted --rollback--> promoted                      (creates a new rollout back to the old version)

A rollback is that new rollout (``rollback_of`` set): it runs through the same states and ends ``promoted`` (the
previous version is promoted again). Pages and messages call it what it is (:func:`state_label`): ``rollback
pending``, ``rolling back``, ``rolled back``.

Operator verbs (API ``POST /api/v1/rollouts/{id}/<verb>/`` and admin actions) are ``VERBS``; the
controller's own events (``step``, ``pause_step``, ``complete``, ``gate_abort``, ``fail``) are in the
same table so there is one source of truth. ``promote`` skips the remaining steps: the rollout goes
to 100% on the new version and then to ``promoted``.
"""

from __future__ import annotations

from apps.core.errors import ConflictError

PENDING, PROGRESSING, PAUSED, PROMOTED, ABORTED, FAILED = (
    "pending", "progressing", "paused", "promoted", "aborted", "failed")
STATES = (PENDING, PROGRESSING, PAUSED, PROMOTED, ABORTED, FAILED)

VERBS = ("start", "pause", "resume", "promote", "abort", "rollback")

TRANSITIONS: dict[str, dict[str, str]] = {
    # operator verbs
    "start": {PENDING: PROGRESSING},
    "pause": {PROGRESSING: PAUSED},
    "resume": {PAUSED: PROGRESSING},
    "promote": {PROGRESSING: PROGRESSING, PAUSED: PROGRESSING},
    "abort": {PENDING: ABORTED, PROGRESSING: ABORTED, PAUSED: ABORTED},
    "rollback": {PROMOTED: PROMOTED},
    # controller events
    "step": {PROGRESSING: PROGRESSING},
    "pause_step": {PROGRESSING: PAUSED},
    "complete": {PROGRESSING: PROMOTED},
    "gate_abort": {PROGRESSING: ABORTED},
    "fail": {PROGRESSING: FAILED, PAUSED: FAILED},
}


ROLLBACK_LABELS = {PENDING: "rollback pending", PROGRESSING: "rolling back", PAUSED: "rollback paused",
                   PROMOTED: "rolled back", ABORTED: "rollback aborted", FAILED: "rollback failed"}


def state_label(state: str, *, is_rollback: bool) -> str:
    """What pages show for ``state``: the state itself, or for a rollback rollout (``rollback_of`` set) its
    :data:`ROLLBACK_LABELS` entry (``promoted`` -> ``rolled back``); an unknown state is shown as it is."""
    return ROLLBACK_LABELS.get(state, state) if is_rollback else state


def allowed_verbs(state: str) -> list[str]:
    """The operator verbs allowed in ``state``, in ``VERBS`` order."""
    return [verb for verb in VERBS if state in TRANSITIONS[verb]]


def next_state(event: str, state: str, *, name: str = "") -> str:
    """The state after ``event`` in ``state``.

    Raises:
        ConflictError: the event is not allowed in this state; the message names the state and
            the verbs that are allowed (HTTP 409).
        KeyError: an unknown event (a programming error).
    """
    targets = TRANSITIONS[event]
    if state not in targets:
        allowed = allowed_verbs(state)
        what = f"Rollout {name!r}" if name else "The rollout"
        hint = f"allowed: {', '.join(allowed)}" if allowed else "no verb is allowed in this state"
        raise ConflictError(f"{what} is {state}; cannot {event} ({hint}).")
    return targets[state]
