"""Rollout gates: telemetry signals of the new track compared with thresholds over a window.

A gate (validated by :mod:`apps.rollouts.validators`) names a gate signal (mapped to the telemetry
signal in ``GATE_SIGNALS``), a comparison and threshold, a window and a ``failure_limit``.
Evaluation reads the telemetry history of each pool the gate applies to (``role``; default the
pools that serve requests: decode and colocated) for the last ``window_s`` seconds and takes the
worst value of the track there: the maximum for ``<``/``<=`` (an upper bound), the minimum for
``>``/``>=``. With ``relative_to_stable`` the value is ``new track / stable track`` at each record
(no data when the stable value is missing or 0). **No data never passes.** A gate fails the
rollout after more than ``failure_limit`` consecutive failed evaluations.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass

from apps.rollouts.validators import GATE_SIGNALS
from apps.telemetry.selectors import telemetry_history

COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
SERVING_ROLES = ("decode", "colocated")


@dataclass(frozen=True)
class Measurement:
    """The outcome of one gate on one pool's track; ``value`` None = no data (a failure)."""

    gate_index: int
    pool_id: int
    track: str
    signal: str
    value: float | None
    threshold: float
    comparison: str
    window_s: int
    passed: bool
    detail: str


def compare(value: float | None, comparison: str, threshold: float) -> bool:
    """Whether ``value <comparison> threshold`` holds; False for no data (None or NaN).

    Raises:
        KeyError: an unknown comparison.
    """
    if value is None or value != value:
        return False
    return COMPARE[comparison](value, threshold)


def _values(records: Iterable[dict], track: str, signal: str, stable: str | None) -> list[float]:
    out = []
    for record in records:
        tracks = record.get("tracks") or {}
        value = (tracks.get(track) or {}).get(signal)
        if value is None or value != value:
            continue
        if stable is not None:
            base = (tracks.get(stable) or {}).get(signal)
            if base is None or base != base or base == 0:
                continue
            value = value / base
        out.append(float(value))
    return out


def gate_worst_value(records: Iterable[dict], *, track: str, signal: str, comparison: str,
                     stable_track: str | None = None) -> float | None:
    """The worst value of ``signal`` for ``track`` in ``records`` (telemetry history records).

    ``records`` are the poller's records (``{"at", "tracks": {track: {signal: value}}}``); worst is
    the max for upper bounds (``<``, ``<=``) and the min for lower bounds. With ``stable_track`` each
    value is divided by the stable track's value in the same record. Returns None with no data.
    """
    values = _values(records, track, signal, stable_track)
    if not values:
        return None
    return max(values) if comparison in ("<", "<=") else min(values)


def gate_pools(gate: dict, pools: Iterable) -> list:
    """The pools a gate applies to: its ``role``'s, else the serving (decode/colocated) pools."""
    pools = list(pools)
    roles = (gate["role"],) if gate.get("role") else SERVING_ROLES
    chosen = [p for p in pools if p.role in roles]
    return chosen or pools


def gates_evaluate(gates: list[dict], *, pools: Iterable, track: str, stable_tracks: dict[int, str],
                   now_s: float | None = None, history=None) -> list[Measurement]:  # noqa: ANN001 - SignalHistory
    """Evaluate every gate on every pool it applies to; one :class:`Measurement` each.

    ``stable_tracks``: pool id -> the name of its stable track (for ``relative_to_stable``).
    Redis errors from the history propagate (``redis.RedisError``).
    """
    now_s = time.time() if now_s is None else now_s
    out = []
    for index, gate in enumerate(gates):
        signal = GATE_SIGNALS[gate["signal"]]
        relative = bool(gate.get("relative_to_stable"))
        for pool in gate_pools(gate, pools):
            records = telemetry_history(pool_id=pool.pk, since_s=now_s - gate["window_s"], history=history)
            records = [r for r in records if r.get("at", 0) <= now_s]
            stable = stable_tracks.get(pool.pk) if relative else None
            value = gate_worst_value(records, track=track, signal=signal, comparison=gate["comparison"],
                                     stable_track=stable)
            passed = compare(value, gate["comparison"], float(gate["threshold"]))
            what = f"{track}/{stable}" if stable else track
            detail = (f"no data for {signal} of {pool} {what} in the last {gate['window_s']}s" if value is None
                      else f"{signal} of {pool} {what} = {value:.6g} (worst of {len(records)} records); "
                           f"needs {gate['comparison']} {gate['threshold']}")
            out.append(Measurement(index, pool.pk, track, gate["signal"], value, float(gate["threshold"]),
                                   gate["comparison"], gate["window_s"], passed, detail[:300]))
    return out
