"""Autoscaler decisions, table-driven: no data, idle, counter reset, min/max, stabilization, schedule windows."""

from datetime import UTC, datetime, time, timedelta

import pytest

from apps.operations.autoscale_math import (
    Observation,
    Policy,
    RateRecord,
    ScheduleWindow,
    decide,
    idle_throughout,
    stabilize,
)
from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.signals import Scope, evaluate_signals
from apps.telemetry.sources.scrape import SampleStore

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)  # a Monday


def policy(**kw):
    base = dict(enabled=True, min_replicas=1, max_replicas=10, signal="num_requests_waiting", target=4.0,
                scale_up_stabilization_s=0, scale_down_stabilization_s=0)
    return Policy(**{**base, **kw})


def obs(current, value, ready=None, now=T0, base=None):
    return Observation(now=now, current_replicas=current, ready_replicas=current if ready is None else ready,
                       value=value, base_replicas=base)


@pytest.mark.parametrize(("case", "pol", "observation", "replicas", "reason_part"), [
    ("no data holds", policy(), obs(3, None), None, "no data for num_requests_waiting: holding at 3"),
    ("NaN is no data", policy(), obs(3, float("nan")), None, "no data"),
    ("average signal without ready replicas holds", policy(signal="kv_cache_usage", target=0.5),
     obs(2, 0.9, ready=0), None, "no ready replicas"),
    ("queue total / target per replica", policy(), obs(2, 20.0), 5, "num_requests_waiting=20 total / target 4"),
    ("within tolerance keeps", policy(), obs(5, 21.0), None, "within tolerance, keep 5"),
    ("average: ceil(ready * value / target)", policy(signal="kv_cache_usage", target=0.5),
     obs(3, 0.9), 6, "ceil(3 x 1.8) = 6"),
    ("latency signal scales down", policy(signal="ttft_p99_seconds", target=2.0), obs(4, 0.5), 1, "= 1"),
    ("max clamps", policy(max_replicas=4), obs(2, 100.0), 4, "clamped to 4 (min 1, max 4)"),
    ("min clamps", policy(min_replicas=2), obs(3, 0.0), 2, "clamped to 2 (min 2, max 10)"),
    ("autoscaling off decides nothing", policy(enabled=False), obs(3, 100.0), None,
     "autoscaling is off and no schedule window is open"),
])
def test_decide(case, pol, observation, replicas, reason_part):
    decision = decide(pol, observation)
    assert decision.replicas == replicas, case
    assert reason_part in decision.reason, (case, decision.reason)


def test_scale_down_waits_for_the_whole_stabilization_window():
    pol = policy(scale_down_stabilization_s=300)
    history = ()
    results = []
    # High load at t=0 (recommend 5), then the queue empties: 1 replica is enough from t=60 s on.
    for t_s, waiting in [(0, 20.0), (60, 0.0), (200, 0.0), (299, 0.0), (301, 0.0)]:
        current = results[-1] if results and results[-1] is not None else 5
        d = decide(pol, obs(current if t_s else 5, waiting, now=T0 + timedelta(seconds=t_s)), history)
        history = d.recommendations
        results.append(d.replicas if d.replicas is not None else current)
    # The t=0 recommendation (5) stays in the 300 s window until t=300: no scale-down before.
    assert results == [5, 5, 5, 5, 1]


def test_scale_up_takes_the_lowest_recommendation_of_its_window():
    pol = policy(scale_up_stabilization_s=60, scale_down_stabilization_s=0)
    d1 = decide(pol, obs(2, 12.0, now=T0))  # recommends 3
    assert d1.replicas == 3 and "stabilized" not in d1.reason
    d2 = decide(pol, obs(3, 40.0, now=T0 + timedelta(seconds=30)), d1.recommendations)  # recommends 10
    assert d2.replicas is None  # min over the last 60 s is 3 = current
    assert "stabilized to 3" in d2.reason
    d3 = decide(pol, obs(3, 40.0, now=T0 + timedelta(seconds=61)), d2.recommendations)
    assert d3.replicas == 10


def test_stabilize_is_hpa_order_current_then_up_then_down():
    history = [(0.0, 2), (50.0, 8), (90.0, 5)]
    assert stabilize(4, 5, history, 100.0, up_window_s=60, down_window_s=120) == 5  # up=min(5,8,5)=5
    assert stabilize(6, 5, history, 100.0, up_window_s=0, down_window_s=30) == 5  # down = max(5 in 30 s)
    assert stabilize(6, 5, history, 100.0, up_window_s=0, down_window_s=120) == 6  # down=8 keeps 6


@pytest.mark.parametrize(("local_time", "weekday_offset", "is_open"), [
    ("21:59", 0, False), ("22:00", 0, True), ("23:59", 0, True),
    ("00:00", 1, True), ("05:59", 1, True), ("06:00", 1, False),
    # Window days name the start day (Mon only): Tuesday 22:00 does not open it; Wednesday 03:00 neither.
    ("22:30", 1, False), ("03:00", 2, False),
    ("03:00", 0, False),  # Monday 03:00 belongs to Sunday night's window, and Sunday is not listed
])
def test_window_across_midnight(local_time, weekday_offset, is_open):
    window = ScheduleWindow(time(22, 0), time(6, 0), replicas=0, days=("mon",))
    zone_now = datetime(2026, 11, 30, int(local_time[:2]), int(local_time[3:]),
                        tzinfo=UTC) + timedelta(days=weekday_offset)
    assert window.is_open(zone_now) is is_open


def test_schedule_window_in_a_time_zone_overrides_then_restores_the_base():
    pol = policy(enabled=False, time_zone="Europe/Paris",
                 windows=(ScheduleWindow(time(22, 0), time(6, 0), replicas=0),))
    # 21:30 UTC = 22:30 Paris (CET, UTC+1): the window is open.
    night = datetime(2026, 11, 30, 21, 30, tzinfo=UTC)
    d = decide(pol, obs(3, None, now=night))
    assert (d.replicas, d.base_replicas, d.window_open) == (0, 3, True)
    assert d.reason == "schedule window 22:00-06:00 Europe/Paris (local Mon 22:30) sets 0"
    again = decide(pol, obs(0, None, now=night + timedelta(hours=2), base=d.base_replicas))
    assert (again.replicas, again.base_replicas) == (None, 3)  # already at 0; remember 3
    morning = decide(pol, obs(0, None, now=datetime(2026, 12, 1, 5, 0, tzinfo=UTC), base=3))  # 06:00 Paris
    assert (morning.replicas, morning.base_replicas) == (3, None)
    assert morning.reason == "schedule windows closed: back to 3"


def _ttft_exposition(counts: dict[str, float], total: float) -> str:
    lines = ["# TYPE ferry_time_to_first_token_seconds histogram"]
    for le, c in counts.items():
        lines.append(f'ferry_time_to_first_token_seconds_bucket{{pool="p",le="{le}"}} {c}')
    lines += [f'ferry_time_to_first_token_seconds_count{{pool="p"}} {total}',
              'ferry_time_to_first_token_seconds_sum{pool="p"} 1.0']
    return "\n".join(lines) + "\n"


def test_counter_reset_in_the_window_does_not_fake_a_latency_change():
    """A worker restart resets its TTFT histogram counters mid-window; rate() handles the reset, so the
    p99 and the decision equal those of the same traffic without a restart."""
    endpoint = ReplicaEndpoint(pool_id="7", track="stable", replica="r0", url="http://127.0.0.1:1")
    decisions = {}
    for label, series in {
        # cumulative counts per scrape: 10 fast (<=0.5 s) and 10 slow (<=4 s) requests per 10 s
        "steady": [(0, 0, 0), (10, 10, 20), (20, 20, 40), (30, 30, 60)],
        "reset": [(0, 0, 0), (10, 10, 20), (20, 10, 20), (30, 20, 40)],  # restarted just before t=20
    }.items():
        store = SampleStore(retention_s=120)
        for t_s, fast, total in series:
            store.ingest(endpoint, _ttft_exposition({"0.5": fast, "4.0": total, "+Inf": total}, total), t_s)
        signals = evaluate_signals(store.view(Scope("7")), Scope("7"), at_s=30, window_s=30, source="scrape")
        p99 = signals.get("ttft_p99_s")
        decisions[label] = (p99, decide(policy(signal="ttft_p99_seconds", target=2.0),
                                        obs(2, p99, ready=2)).replicas)
    assert decisions["reset"] == decisions["steady"]
    p99, replicas = decisions["steady"]
    assert p99 == pytest.approx(0.5 + (4.0 - 0.5) * (0.99 * 20 - 10) / 10)  # linear within the (0.5, 4] bucket
    assert replicas == 4  # ceil(2 x 3.965 / 2)


IDLE = RateRecord  # (at_s, source, request_rate_per_s, ready_replicas)


@pytest.mark.parametrize(("case", "pol", "observation", "replicas", "reason_part"), [
    ("idle latency signal scales to min", policy(signal="ttft_p99_seconds", target=2.0, min_replicas=2),
     Observation(now=T0, current_replicas=6, ready_replicas=6, value=None, idle=True), 2,
     "idle: request rate 0 throughout the 0s scale-down window, ttft_p99_seconds has no requests -> 2"),
    ("idle never parks a latency-scaled pool at 0", policy(signal="tpot_p99_seconds", target=0.1, min_replicas=0),
     Observation(now=T0, current_replicas=3, ready_replicas=3, value=None, idle=True), 1, "-> 1"),
    ("empty latency without idle holds", policy(signal="ttft_p99_seconds", target=2.0),
     Observation(now=T0, current_replicas=6, ready_replicas=6, value=None, idle=False), None,
     "no data for ttft_p99_seconds: holding at 6"),
    ("idle does not turn a missing gauge into a value", policy(signal="kv_cache_usage", target=0.5),
     Observation(now=T0, current_replicas=3, ready_replicas=3, value=None, idle=True), None, "no data"),
    ("a latency value wins over idle", policy(signal="ttft_p99_seconds", target=2.0),
     Observation(now=T0, current_replicas=2, ready_replicas=2, value=4.0, idle=True), 4, "ceil(2 x 2) = 4"),
])
def test_decide_when_idle(case, pol, observation, replicas, reason_part):
    decision = decide(pol, observation)
    assert decision.replicas == replicas, case
    assert reason_part in decision.reason, (case, decision.reason)


def _zeros(times, source="scrape", rate=0.0, ready=2.0):
    return [IDLE(t, source, rate, ready) for t in times]


@pytest.mark.parametrize(("case", "records", "idle"), [
    ("zero every 5 s across the window", _zeros(range(0, 101, 5)), True),
    ("window starts more than a gap before the first record", _zeros(range(50, 101, 5)), False),
    ("first record within one gap of the start", _zeros(range(44, 101, 4)), True),
    ("one unreadable rate", _zeros(range(0, 50, 5)) + _zeros([50], rate=None) + _zeros(range(55, 101, 5)), False),
    ("one non-zero rate", _zeros(range(0, 50, 5)) + _zeros([50], rate=0.2) + _zeros(range(55, 101, 5)), False),
    ("NaN rate", _zeros(range(0, 50, 5)) + _zeros([50], rate=float("nan")) + _zeros(range(55, 101, 5)), False),
    ("no replica answering", _zeros(range(0, 50, 5)) + _zeros([50], ready=0.0) + _zeros(range(55, 101, 5)), False),
    ("unknown ready count", _zeros(range(0, 50, 5)) + _zeros([50], ready=None) + _zeros(range(55, 101, 5)), False),
    ("poller gap longer than allowed", _zeros(range(0, 50, 5)) + _zeros(range(60, 101, 5)), False),
    ("source changed inside the window", _zeros(range(0, 50, 5), source="prometheus") + _zeros(range(50, 101, 5)),
     False),
    ("source changed before the window", _zeros(range(0, 40, 5), source="prometheus") + _zeros(range(40, 101, 5)),
     True),
    ("latest record too old", _zeros(range(0, 90, 5)), False),
    ("non-zero before the window does not count", _zeros(range(0, 40, 5), rate=3.0) + _zeros(range(40, 101, 5)),
     True),
])
def test_idle_throughout_needs_a_readable_zero_rate_covering_the_window(case, records, idle):
    # now = 100 s, window 60 s ([40, 100]), records at most 8 s apart count as continuous
    assert idle_throughout(records, now_s=100.0, window_s=60.0, max_gap_s=8.0) is idle, case


def test_idle_throughout_with_a_zero_window_reads_the_latest_record():
    assert idle_throughout(_zeros([97]), now_s=100.0, window_s=0.0, max_gap_s=8.0) is True
    assert idle_throughout(_zeros([97], rate=None), now_s=100.0, window_s=0.0, max_gap_s=8.0) is False
    with pytest.raises(ValueError, match="max_gap_s > 0"):
        idle_throughout([], now_s=100.0, window_s=60.0, max_gap_s=0.0)
