"""The autoscaler's decision function: pure, no Django, no clock — everything comes in as arguments.

One evaluation of one pool (prefill and decode pools are evaluated independently, each on its own
signal and policy):

1. **Schedule windows** (in the policy's IANA time zone): while a window is open the total is the
   window's ``replicas`` (not clamped: a window may park a pool at 0). A window whose ``end`` is
   before its ``start`` crosses midnight; its ``days`` name the day it *starts* (a Friday 22:00-06:00
   window is open Saturday 03:00). When the last window closes, the total in force before it opened
   (``base_replicas``) comes back unless autoscaling is on.
2. **Signal** (autoscaling on): ``num_requests_waiting`` is the pool's total queue, so
   ``raw = ceil(total / target)`` (target = waiting requests per replica). The other signals are
   per-replica averages or latencies (KV cache usage, engine busy ratio, GPU utilization, TTFT/TPOT
   p99), so ``raw = ceil(ready * value / target)`` — Kubernetes HPA's
   ``desired = ceil(current * metric / target)``. Within ``tolerance`` (default 0.1) of the target
   the total is kept. A missing/NaN value or unknown ready count is "no data": hold, decide nothing.
   **Idle is not "no data"**: a latency signal (TTFT/TPOT p99) has no value when no request
   finished in its window, which is also what an idle pool looks like. When the observation says
   the pool was idle (``Observation.idle``: the request-rate counter from the same source answered
   exactly 0 throughout the scale-down stabilization window, :func:`idle_throughout`), the
   recommendation is ``max(min_replicas, 1)`` — the seeds' off-peak scale-down "可缩容至1个实例，
   保留模型常驻" (003, scale to one instance and keep the model resident): never 0, since a pool
   with no ready replica has no latency to scale back up on. An unreadable source is not idle: hold.
3. **min/max**: ``raw`` is clamped to ``[min_replicas, max_replicas]``.
4. **Stabilization** (HPA's behavior): recommendations are kept with their time; the result is
   ``max`` of the recommendations in the last ``scale_down_stabilization_s`` (so a dip must last
   the whole window before scaling down) and ``min`` of those in the last ``scale_up_stabilization_s``,
   applied as HPA does: ``r = current; r = max(r, up); r = min(r, down)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, time
from zoneinfo import ZoneInfo

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
TOTAL_SIGNALS = {"num_requests_waiting"}
LATENCY_SIGNALS = {"ttft_p99_seconds", "tpot_p99_seconds"}  # empty when nothing finished: idle or unreadable
SIGNAL_NAMES = {  # pool policy choice -> telemetry signal name
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage": "kv_cache_usage",
    "ttft_p99_seconds": "ttft_p99_s",
    "tpot_p99_seconds": "tpot_p99_s",
    "engine_busy_ratio": "engine_busy_ratio",
    "gpu_utilization": "gpu_utilization",
}


@dataclass(frozen=True)
class ScheduleWindow:
    """``[start, end)`` local time with a fixed total; ``end <= start`` wraps past midnight."""

    start: time
    end: time
    replicas: int
    days: tuple[str, ...] = WEEKDAYS

    def __post_init__(self) -> None:
        if self.start == self.end:
            raise ValueError("a schedule window needs start != end")
        if self.replicas < 0 or any(d not in WEEKDAYS for d in self.days):
            raise ValueError(f"bad schedule window: replicas {self.replicas}, days {self.days}")

    @classmethod
    def from_dict(cls, data: dict) -> ScheduleWindow:
        """From the pool's JSON ``{"start": "HH:MM", "end": "HH:MM", "replicas": N, "days": [...]}``."""
        start, end = (time(int(data[k][:2]), int(data[k][3:5])) for k in ("start", "end"))
        return cls(start, end, int(data["replicas"]), tuple(data.get("days") or WEEKDAYS))

    def is_open(self, local: datetime) -> bool:
        """Whether the window is open at ``local`` (a datetime in the policy's time zone)."""
        t, day = local.time(), WEEKDAYS[local.weekday()]
        if self.start < self.end:
            return day in self.days and self.start <= t < self.end
        previous_day = WEEKDAYS[(local.weekday() - 1) % 7]
        return (day in self.days and t >= self.start) or (previous_day in self.days and t < self.end)

    def describe(self) -> str:
        return f"{self.start:%H:%M}-{self.end:%H:%M}"


@dataclass(frozen=True)
class Policy:
    """A pool's autoscaling policy (fields of ``Pool``)."""

    enabled: bool
    min_replicas: int
    max_replicas: int
    signal: str
    target: float
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    windows: tuple[ScheduleWindow, ...] = ()
    time_zone: str = "UTC"
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        if self.signal not in SIGNAL_NAMES:
            raise ValueError(f"unknown autoscaling signal {self.signal!r}; known: {sorted(SIGNAL_NAMES)}")
        if not (math.isfinite(self.target) and self.target > 0) or not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need target > 0 and 0 <= min <= max, got {self.target}, {self.min_replicas}, "
                             f"{self.max_replicas}")


@dataclass(frozen=True)
class Observation:
    """What the autoscaler sees now: the desired total, ready replicas and the signal's value."""

    now: datetime  # timezone-aware
    current_replicas: int
    ready_replicas: int | None
    value: float | None
    base_replicas: int | None = None  # the total before the open schedule window (from the last decision)
    idle: bool = False  # request rate answered 0 throughout the scale-down window (``idle_throughout``)


@dataclass(frozen=True)
class Decision:
    """The outcome: ``replicas`` None = hold (decide nothing); the history and base to keep."""

    replicas: int | None
    reason: str
    recommendations: tuple[tuple[float, int], ...] = ()
    base_replicas: int | None = None
    window_open: bool = False

    @property
    def changes(self) -> bool:
        return self.replicas is not None


@dataclass
class _Raw:
    replicas: int | None
    reason: str


def raw_recommendation(policy: Policy, obs: Observation) -> _Raw:
    """Step 2 of the module docstring: the unclamped recommendation from the signal, or None (no data)."""
    value = obs.value
    if (value is None or not math.isfinite(value)) and obs.idle and policy.signal in LATENCY_SIGNALS:
        idle = max(policy.min_replicas, 1)
        return _Raw(idle, f"idle: request rate 0 throughout the {policy.scale_down_stabilization_s:g}s scale-down "
                          f"window, {policy.signal} has no requests -> {idle}")
    if value is None or not math.isfinite(value):
        return _Raw(None, f"no data for {policy.signal}: holding at {obs.current_replicas}")
    if policy.signal in TOTAL_SIGNALS:
        raw = math.ceil(value / policy.target)
        base = f"{policy.signal}={value:g} total / target {policy.target:g} per replica"
        if obs.current_replicas and abs(value / (policy.target * obs.current_replicas) - 1) <= policy.tolerance:
            return _Raw(obs.current_replicas, f"{base}: within tolerance, keep {obs.current_replicas}")
        return _Raw(raw, f"{base} -> {raw}")
    ready = obs.ready_replicas
    if not ready:
        return _Raw(None, f"no ready replicas to average {policy.signal} over: holding at {obs.current_replicas}")
    ratio = value / policy.target
    base = f"{policy.signal}={value:g} vs target {policy.target:g} on {ready} ready"
    if abs(ratio - 1) <= policy.tolerance:
        return _Raw(obs.current_replicas, f"{base}: within tolerance, keep {obs.current_replicas}")
    raw = math.ceil(ready * ratio)
    return _Raw(raw, f"{base} -> ceil({ready} x {ratio:.3g}) = {raw}")


@dataclass(frozen=True)
class RateRecord:
    """One telemetry record as the idle rule reads it: when, which source, request rate, ready replicas."""

    at_s: float
    source: str
    request_rate_per_s: float | None
    ready_replicas: float | None


def idle_throughout(records: Sequence[RateRecord], *, now_s: float, window_s: float, max_gap_s: float) -> bool:
    """Whether the pool was idle for the whole window ``[now_s - window_s, now_s]`` (seconds).

    True only when every record in the window comes from the latest record's source, reads a
    request rate of exactly 0 (``None`` = unreadable, never idle) with at least one ready replica
    answering, and the records cover the window: the first is at most ``max_gap_s`` after the
    window's start, consecutive ones at most ``max_gap_s`` apart, the last at most ``max_gap_s``
    before ``now_s`` (a poller that stopped leaves a gap, and a gap is not a zero). With
    ``window_s`` 0 the latest record alone decides. Raises ``ValueError`` for a negative window
    or a non-positive ``max_gap_s``.
    """
    if window_s < 0 or max_gap_s <= 0:
        raise ValueError(f"need window_s >= 0 and max_gap_s > 0, got {window_s}, {max_gap_s}")
    ordered = sorted((r for r in records if r.at_s <= now_s), key=lambda r: r.at_s)
    if not ordered or now_s - ordered[-1].at_s > max_gap_s:
        return False
    start_s = now_s - window_s
    inside = [r for r in ordered if r.at_s >= start_s] or [ordered[-1]]
    if inside[0].at_s - start_s > max_gap_s and window_s > 0:
        return False
    source = ordered[-1].source
    previous_s = inside[0].at_s
    for record in inside:
        if record.at_s - previous_s > max_gap_s or record.source != source:
            return False
        if record.request_rate_per_s is None or record.request_rate_per_s != 0.0:
            return False
        if record.ready_replicas is None or record.ready_replicas < 1:
            return False
        previous_s = record.at_s
    return True


def stabilize(current: int, recommendation: int, history: Sequence[tuple[float, int]], now_s: float,
              up_window_s: float, down_window_s: float) -> int:
    """HPA's stabilization over ``history`` (``(unix seconds, replicas)``, including the new one)."""
    up = down = recommendation
    for at_s, replicas in history:
        if at_s > now_s - up_window_s:
            up = min(up, replicas)
        if at_s > now_s - down_window_s:
            down = max(down, replicas)
    result = max(current, up)
    return min(result, down)


def decide(policy: Policy, obs: Observation, history: Sequence[tuple[float, int]] = ()) -> Decision:
    """One evaluation (module docstring); ``history`` is the previous decision's ``recommendations``."""
    now_s = obs.now.timestamp()
    keep_s = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    kept = tuple((t, n) for t, n in history if t > now_s - keep_s)
    zone = ZoneInfo(policy.time_zone)
    local = obs.now.astimezone(zone)
    open_windows = [w for w in policy.windows if w.is_open(local)]
    if open_windows:
        window = open_windows[0]
        base = obs.base_replicas if obs.base_replicas is not None else obs.current_replicas
        reason = (f"schedule window {window.describe()} {policy.time_zone} (local {local:%a %H:%M}) "
                  f"sets {window.replicas}")
        target = window.replicas if window.replicas != obs.current_replicas else None
        return Decision(target, reason, kept, base_replicas=base, window_open=True)
    if not policy.enabled:
        if obs.base_replicas is not None:
            target = obs.base_replicas if obs.base_replicas != obs.current_replicas else None
            return Decision(target, f"schedule windows closed: back to {obs.base_replicas}", kept)
        return Decision(None, "autoscaling is off and no schedule window is open", kept)
    raw = raw_recommendation(policy, obs)
    if raw.replicas is None:
        return Decision(None, raw.reason, kept)
    clamped = min(max(raw.replicas, policy.min_replicas), policy.max_replicas)
    reason = raw.reason
    if clamped != raw.replicas:
        reason += f", clamped to {clamped} (min {policy.min_replicas}, max {policy.max_replicas})"
    history_now = (*kept, (now_s, clamped))
    final = stabilize(obs.current_replicas, clamped, history_now, now_s, policy.scale_up_stabilization_s,
                      policy.scale_down_stabilization_s)
    if final != clamped:
        reason += (f"; stabilized to {final} (up window {policy.scale_up_stabilization_s:g}s, "
                   f"down window {policy.scale_down_stabilization_s:g}s)")
    return Decision(final if final != obs.current_replicas else None, reason, history_now)

