"""Step machinery shared by canary and blue-green: scheduling, deadlines, step claims, pauses, analysis.

A tick of a progressing rollout (:func:`apps.rollouts.controller.rollout_tick`) runs with the plan
row locked. ``current_step_index`` is the index of the next step to apply; applying step ``i`` is
claimed with a conditional update on ``(id, state=progressing, current_step_index=i)`` that moves it
to ``i + 1``, so a duplicate delivery of the same step task applies it once (one ``rollout.step``
Action, one routing-table version). A failing gate or a missed deadline raises :class:`RolloutFailure`,
which the controller turns into an abort or a failure that sends traffic back to stable.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings

from apps.fleet.models import Replica
from apps.rollouts import transitions
from apps.rollouts.desired import PoolView, record_action
from apps.rollouts.gates import gates_evaluate
from apps.rollouts.models import GateMeasurement, RolloutPlan
from apps.rollouts.progress import Analysis


class RolloutFailure(Exception):
    """The rollout must stop: ``event`` is ``gate_abort`` (-> aborted) or ``fail`` (-> failed)."""

    def __init__(self, event: str, reason: str) -> None:
        super().__init__(reason)
        self.event, self.reason = event, reason


def tick_interval_s() -> float:
    """Seconds between ticks of a rollout that waits (``FERRY_ROLLOUT_TICK_S``, default 2)."""
    return float(getattr(settings, "FERRY_ROLLOUT_TICK_S", 2.0))


def step_text(step: dict) -> str:
    """A step for operators: ``set weight 50%``, ``pause 20 s``, ``pause until resumed``, ``analysis for 60 s``."""
    (kind, arg), = step.items()
    if kind == "set_weight":
        return f"set weight {arg}%"
    if kind == "pause":
        return f"pause {arg['seconds']} s" if "seconds" in arg else "pause until resumed"
    return f"analysis for {arg['duration_s']} s" if arg.get("duration_s") else "analysis"


def step_label(plan: RolloutPlan, index: int) -> str:
    """``step N of M (<step>)`` for the step at 0-based ``index``: operators count steps from 1.

    The one convention of every message, log line and error text; the API keeps ``current_step_index``
    and ``step_index`` 0-based.
    """
    return f"step {index + 1} of {len(plan.steps)} ({step_text(plan.steps[index])})"


def completed_message(plan: RolloutPlan) -> str:
    """The message of a rollout that completed: ``Promoted: every pool runs <target>.``, or for a rollback rollout
    (``rollback_of`` set) ``Rolled back: every pool runs <target> again (rollback of rollout #<id>).``"""
    if plan.rollback_of_id is not None:
        return (f"Rolled back: every pool runs {plan.target_model_version} again "
                f"(rollback of rollout #{plan.rollback_of_id}).")
    return f"Promoted: every pool runs {plan.target_model_version}."


def step_position(plan: RolloutPlan) -> str:
    """Where ``plan`` is: the last step started (``current_step_index`` counts them, so it is that step's
    1-based number), ``before step 1 of M``, or ``no steps``."""
    started, total = plan.current_step_index, len(plan.steps)
    if total == 0:
        return "no steps"
    if started == 0:
        return f"before step 1 of {total}"
    return step_label(plan, min(started, total) - 1)


def schedule(plan: RolloutPlan, now: datetime, seconds: float | None = None) -> None:
    """Set ``next_step_at`` to ``now + seconds`` (default: one tick interval)."""
    plan.next_step_at = now + timedelta(seconds=tick_interval_s() if seconds is None else seconds)


def replica_failures(plan: RolloutPlan) -> str:
    """Why replicas of the plan's pools are down: ``"; "``-joined ``pool: replica X is not running (exit
    code C, N restarts): <termination message>`` for every replica that is not ready and died with a
    known exit code or message (a worker whose model fails to load says so), "" if none (1 query)."""
    rows = (Replica.objects.filter(pool__in=plan.pools.all(), ready=False)
            .exclude(exit_code__isnull=True, message="").select_related("pool").order_by("pool_id", "name"))
    parts = []
    for r in rows:
        text = f"{r.pool.name}: replica {r.name} is not running (exit code {r.exit_code}, {r.restart_count} restarts)"
        parts.append(f"{text}: {r.message}" if r.message else text)
    return "; ".join(parts)


def waiting_text(plan: RolloutPlan, waiting_for: str) -> str:
    """``waiting_for`` followed by the replica failures of the plan's pools (what an operator needs to act)."""
    failures = replica_failures(plan)
    return f"{waiting_for} ({failures})" if failures else waiting_for


def check_deadline(plan: RolloutPlan, now: datetime, waiting_for: str) -> None:
    """Raise ``RolloutFailure("fail")`` if the current step started more than ``progress_deadline_s`` ago.

    The failure message names what it waited for and why replicas are down (``waiting_text``).
    """
    started = plan.step_started_at
    if started is not None and (now - started).total_seconds() > plan.progress_deadline_s:
        raise RolloutFailure("fail", f"progress deadline of {plan.progress_deadline_s}s exceeded while waiting for "
                                     f"{waiting_text(plan, waiting_for)}")


def claim_step(plan: RolloutPlan, index: int) -> bool:
    """Move ``current_step_index`` from ``index`` to ``index + 1`` if the plan is still progressing there."""
    moved = RolloutPlan.objects.filter(pk=plan.pk, state=transitions.PROGRESSING, current_step_index=index).update(
        current_step_index=index + 1) == 1
    if moved:
        plan.current_step_index = index + 1
    return moved


def apply_pause_or_analysis(plan: RolloutPlan, index: int, kind: str, arg: dict, now: datetime,
                            lines: list[str]) -> str:
    """Start a ``pause`` or ``analysis`` step (already claimed); returns the tick's outcome word."""
    if kind == "pause":
        if "seconds" in arg:
            schedule(plan, now, arg["seconds"])
            lines.append(f"paused for {arg['seconds']}s")
            return "paused-timed"
        plan.state = transitions.next_state("pause_step", plan.state, name=plan.name)
        plan.next_step_at = None
        plan.message = f"Paused at {step_label(plan, index)} until resumed or promoted."
        lines.append("paused until resumed or promoted")
        return "paused"
    until = now + timedelta(seconds=arg["duration_s"]) if "duration_s" in arg else None
    plan.typed_progress.analysis = Analysis(step=index, until=until)
    schedule(plan, now, 0)
    lines.append("analysis started" + (f" for {arg['duration_s']}s" if until else " (until the gates pass)"))
    return "analysis"


def analysis_gates(plan: RolloutPlan, step: int) -> list[dict]:
    """The gates of analysis step ``step`` (-1: the plan's gates), falling back to the plan's."""
    if 0 <= step < len(plan.steps):
        own = plan.steps[step].get("analysis", {}).get("gates")
        if own:
            return own
    return list(plan.gates)


def analysis_tick(plan: RolloutPlan, views: list[PoolView], now: datetime, *, new_track: str,
                  stable_tracks: dict[int, str], history=None) -> bool:  # noqa: ANN001 - SignalHistory
    """Evaluate the running analysis once; True when it passed (and is cleared).

    Each measurement is stored as a ``GateMeasurement`` with its consecutive-failure count. More
    than ``failure_limit`` consecutive failures of a gate on a pool raise ``RolloutFailure``
    (``gate_abort``) naming the failing measurement. Without ``duration_s`` the analysis passes at
    the first evaluation where every gate passes; with it, at the first all-pass evaluation after
    the duration.
    """
    state = plan.typed_progress.analysis
    gates = analysis_gates(plan, state.step)
    measurements = gates_evaluate(gates, pools=[v.pool for v in views], track=new_track, stable_tracks=stable_tracks,
                                  now_s=now.timestamp(), history=history)
    failures = state.failures
    rows, broken = [], None
    for m in measurements:
        key = f"{m.gate_index}:{m.pool_id}"
        failures[key] = 0 if m.passed else failures.get(key, 0) + 1
        rows.append(GateMeasurement(
            rollout=plan, step_index=state.step, gate_index=m.gate_index, pool_id=m.pool_id, track=m.track,
            signal=m.signal, value=m.value, threshold=m.threshold, comparison=m.comparison, window_s=m.window_s,
            passed=m.passed, consecutive_failures=failures[key], detail=m.detail, measured_at=now))
        if broken is None and failures[key] > gates[m.gate_index].get("failure_limit", 0):
            broken = (m, failures[key])
    GateMeasurement.objects.bulk_create(rows)
    if broken is not None:
        m, count = broken
        raise RolloutFailure("gate_abort", f"gate {m.gate_index + 1} failed {count} time(s) in a row: {m.detail}")
    all_passed = all(m.passed for m in measurements)
    if all_passed and (state.until is None or now >= state.until):
        plan.typed_progress.analysis = None
        where = step_label(plan, state.step) if 0 <= state.step < len(plan.steps) else "the plan's gates"
        record_action(plan, "rollout.step", [f"analysis of {where} passed ({len(measurements)} measurements)"],
                      params={"analysis_passed": state.step})
        return True
    schedule(plan, now)
    return False
