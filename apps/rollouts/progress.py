"""``RolloutProgress``: the typed form of ``RolloutPlan.progress`` (the controller's bookkeeping JSON).

The JSON keeps its keys (the API shows it, ``rollouts.tick`` filters on ``progress__cleanup``); keys whose value
is ``None`` are left out, so ``"switched_at" in plan.progress`` still means "the switch happened". Where the
controller is inside a state lives in ``RolloutPlan.phase`` (an enum); the old ``progress["mode"]`` duplicated
it and is dropped on load (migration ``0004`` removed it from stored rows). :meth:`RolloutProgress.from_json`
raises :class:`ProgressError` naming the key, the value and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

LEGACY_KEYS = ("mode",)
"""Keys of older rows that are ignored on load (``mode`` is ``RolloutPlan.phase`` now)."""


class ProgressError(ValueError):
    """A stored ``progress`` value has the wrong type or range."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _map_of(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _iso(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


_COUNT = lambda v: _is_int(v) and v >= 0  # noqa: E731 - a small predicate table reads best inline
_PERCENT = lambda v: _is_int(v) and 0 <= v <= 100  # noqa: E731
_STR = lambda v: isinstance(v, str)  # noqa: E731


ANALYSIS_CHECKS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "step": ("an integer", _is_int), "until": ("an ISO-8601 time or null", _optional(_iso)),
    "failures": ("an object of counts", _map_of(_COUNT)),
}


@dataclass
class Analysis:
    """A running analysis step: its index (-1: the plan's gates before a blue-green switch), when it may pass
    (``None``: as soon as every gate passes) and the consecutive failures per ``"<gate index>:<pool id>"``."""

    step: int
    until: datetime | None = None
    failures: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: object) -> Analysis:
        """Raises ProgressError on a missing step or a bad value."""
        if not isinstance(data, dict) or "step" not in data:
            raise ProgressError(f"progress.analysis must be an object with a step, got {data!r}")
        _validate("progress.analysis", data, ANALYSIS_CHECKS)
        until = datetime.fromisoformat(data["until"]) if data.get("until") else None
        return cls(step=data["step"], until=until, failures=dict(data.get("failures", {})))

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "until": self.until.isoformat() if self.until else None,
                "failures": dict(self.failures)}


@dataclass
class RolloutProgress:
    """The controller's bookkeeping of one rollout. Pool keys are pool ids as strings (JSON object keys)."""

    totals: dict[str, int] = field(default_factory=dict)
    """Pool total replicas ``R`` recorded at start; the split between tracks is computed from it."""
    stable_tracks: dict[str, str] = field(default_factory=dict)
    """The track serving the stable version per pool (``stable``, ``blue`` or ``green``)."""
    new_tracks: dict[str, str] = field(default_factory=dict)
    """Blue-green: the preview track per pool."""
    stable_worker_args: dict[str, str] = field(default_factory=dict)
    """The stable track's worker options at start (a rollback after promotion restores them)."""
    weight: int = 0
    """Canary: the target weight of the current step, percent."""
    applied_weight: int = 0
    """Canary: the weight written to the tracks (what may be served now), percent."""
    await_version: int | None = None
    """The routing-table version the router must report before the step counts as applied."""
    scale_down_held: str | None = None
    """Why a shrinking track keeps its replicas for now (None: nothing held)."""
    analysis: Analysis | None = None
    cleanup: bool = False
    """Aborted or failed: the new tracks are still being removed (the beat tick keeps converging)."""
    switched_services: dict[str, str] = field(default_factory=dict)
    """Blue-green: the track each pool's backend ``switch_active`` succeeded for."""
    switch_actions: dict[str, int] = field(default_factory=dict)
    """Blue-green: the id of the newest ``pool.switch_active`` Action per pool."""
    switched_at: datetime | None = None
    """Blue-green: when the switch was complete (the scale-down delay counts from it)."""
    num_track_changes: int = 0
    """Pool-track Actions requested so far (their idempotency keys count with it)."""

    @property
    def started(self) -> bool:
        return bool(self.stable_tracks)

    @classmethod
    def from_json(cls, data: object) -> RolloutProgress:
        """Parse stored ``progress`` (``{}`` or ``None``: a rollout that has not started).

        Raises:
            ProgressError: not an object, an unknown key, or a value of the wrong type or range.
        """
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ProgressError(f"progress must be a JSON object, got {type(data).__name__}")
        values = {k: v for k, v in data.items() if k not in LEGACY_KEYS}
        _validate("progress", values, CHECKS)
        if values.get("analysis") is not None:
            values["analysis"] = Analysis.from_json(values["analysis"])
        if values.get("switched_at") is not None:
            values["switched_at"] = datetime.fromisoformat(values["switched_at"])
        return cls(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()})

    def to_json(self) -> dict[str, Any]:
        """The JSON form (``None`` values left out)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, Analysis):
                value = value.to_json()
            elif isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out


CHECKS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "totals": ("an object of replica counts", _map_of(_COUNT)),
    "stable_tracks": ("an object of track names", _map_of(_STR)),
    "new_tracks": ("an object of track names", _map_of(_STR)),
    "stable_worker_args": ("an object of strings", _map_of(_STR)),
    "weight": ("a percentage 0..100", _PERCENT),
    "applied_weight": ("a percentage 0..100", _PERCENT),
    "await_version": ("an integer or null", _optional(_is_int)),
    "scale_down_held": ("a string or null", _optional(_STR)),
    "analysis": ("an object or null", _optional(lambda v: isinstance(v, dict))),
    "cleanup": ("true or false", lambda v: isinstance(v, bool)),
    "switched_services": ("an object of track names", _map_of(_STR)),
    "switch_actions": ("an object of Action ids", _map_of(_COUNT)),
    "switched_at": ("an ISO-8601 time or null", _optional(_iso)),
    "num_track_changes": ("a count", _COUNT),
}


def _validate(where: str, values: dict, checks: dict[str, tuple[str, Callable[[object], bool]]]) -> None:
    unknown = sorted(set(values) - set(checks))
    if unknown:
        raise ProgressError(f"{where} has unknown key(s) {unknown}; known: {sorted(checks)}")
    for key, value in values.items():
        expected, check = checks[key]
        if not check(value):
            raise ProgressError(f"{where}.{key} must be {expected}, got {value!r}")
