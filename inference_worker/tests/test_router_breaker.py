"""The router's circuit breaker (seed 003 9.1) on a fake clock, and eligibility when ejection empties a track.

Exact transitions: which outcome ejects (error rate strictly above the threshold once the window holds
``min_requests``, or ``max_consecutive_failures`` in a row), the cooldown, one probe at a time when
half-open, a failed probe doubling the cooldown up to its cap, and outcomes leaving the window.
"""

import pytest

from inference_worker.router.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker, Transition
from inference_worker.router.decisions import NoReplicaAvailable, track_bucket
from inference_worker.router.pipeline import eligibility
from inference_worker.router.table import RoutingTable


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def breaker(**overrides):
    clock = Clock()
    config = dict(window_s=10.0, max_error_rate=0.05, min_requests=20, max_consecutive_failures=5,
                  cooldown_s=30.0, max_cooldown_s=100.0)
    return CircuitBreaker(BreakerConfig(**{**config, **overrides}), clock), clock


def test_exactly_five_percent_keeps_the_replica_and_one_failure_more_ejects_it():
    b, clock = breaker()
    for _ in range(19):
        assert b.record("r0", True) is None
    assert b.record("r0", False) is None  # 1 of 20 = 5%: not above
    assert b.ejected() == frozenset()
    change = b.record("r0", False)  # 2 of 21 = 9.5%
    assert change == Transition("r0", OPEN, "error_rate", failures=2, requests=21)
    assert b.ejected() == {"r0"} and b.state("r0") == OPEN


def test_the_error_rate_needs_min_requests_but_consecutive_failures_do_not():
    b, _ = breaker()
    outcomes = [b.record("r0", ok) for ok in (False, True, False, True, False, True, False, True)]
    assert outcomes == [None] * 8  # 50% errors, but only 8 outcomes and never 5 in a row
    assert [b.record("r0", False) for _ in range(5)][-1] == Transition("r0", OPEN, "consecutive_failures", 9, 13)
    assert b.ejected() == {"r0"}


def test_client_errors_are_successes_and_a_success_resets_the_run_of_failures():
    b, _ = breaker(min_requests=100)
    for _ in range(10):
        for ok in (False, False, False, False, True):  # four in a row, then a 2xx or a 4xx
            assert b.record("r0", ok) is None
    assert b.ejected() == frozenset()


def test_outcomes_older_than_the_window_no_longer_count():
    b, clock = breaker(min_requests=4, max_error_rate=0.4)
    b.record("r0", False)
    b.record("r0", False)
    clock.now += 10.0  # the two failures are exactly window_s old: out
    assert [b.record("r0", ok) for ok in (True, True, False)] == [None, None, None]
    assert b.record("r0", False) == Transition("r0", OPEN, "error_rate", failures=2, requests=4)


def test_cooldown_then_one_probe_at_a_time_and_a_good_probe_restores_the_replica():
    b, clock = breaker(max_consecutive_failures=2)
    b.record("r0", False)
    assert b.record("r0", False).state == OPEN
    clock.now += 29.9
    assert b.ejected() == {"r0"}
    clock.now += 0.1
    assert b.state("r0") == HALF_OPEN and b.ejected() == frozenset()
    b.attempt("r0")  # the probe is in flight: no second request meanwhile
    assert b.ejected() == {"r0"}
    assert b.record("r0", True) == Transition("r0", CLOSED)
    assert b.state("r0") == CLOSED and b.ejected() == frozenset()
    b.record("r0", False)  # a fresh window: one failure does not eject
    assert b.ejected() == frozenset()


def test_a_failed_probe_doubles_the_cooldown_up_to_the_cap_and_a_restore_resets_it():
    b, clock = breaker(max_consecutive_failures=1, cooldown_s=30.0, max_cooldown_s=100.0)
    assert b.record("r0", False).reason == "consecutive_failures"
    for cooldown in (60.0, 100.0, 100.0):
        clock.now += 100.0 if cooldown != 60.0 else 30.0
        b.attempt("r0")
        assert b.record("r0", False) == Transition("r0", OPEN, "probe_failed", failures=1, requests=1)
        clock.now += cooldown - 0.1
        assert b.state("r0") == OPEN
        clock.now -= cooldown - 0.1
    clock.now += 100.0
    b.attempt("r0")
    assert b.record("r0", True).state == CLOSED
    assert b.record("r0", False).state == OPEN  # the cooldown is back to 30 s
    clock.now += 30.0
    assert b.state("r0") == HALF_OPEN


def test_a_probe_the_client_abandoned_lets_the_next_request_probe():
    b, clock = breaker(max_consecutive_failures=1)
    b.record("r0", False)
    clock.now += 30.0
    b.attempt("r0")
    assert b.ejected() == {"r0"}
    b.release("r0")
    assert b.ejected() == frozenset() and b.state("r0") == HALF_OPEN


def test_late_outcomes_of_an_ejected_replica_change_nothing_and_disabled_never_ejects():
    b, clock = breaker(max_consecutive_failures=1)
    b.record("r0", False)
    assert b.record("r0", True) is None and b.state("r0") == OPEN
    off, _ = breaker(enabled=False, max_consecutive_failures=1)
    assert [off.record("r0", False) for _ in range(50)] == [None] * 50 and off.ejected() == frozenset()


@pytest.mark.parametrize("kwargs", [dict(max_error_rate=1.0), dict(min_requests=0), dict(window_s=0),
                                    dict(max_consecutive_failures=0), dict(cooldown_s=60.0, max_cooldown_s=30.0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        BreakerConfig(**kwargs)


def canary_table():
    return RoutingTable.from_dict({
        "version": 1,
        "tracks": [{"name": "stable", "model_version": "v1", "weight": 50},
                   {"name": "canary", "model_version": "v2", "weight": 50}],
        "pools": [{"name": "decode", "role": "decode", "replicas": [
                      {"name": "s0", "url": "http://s0", "track": "stable", "model_version": "v1"},
                      {"name": "s1", "url": "http://s1", "track": "stable", "model_version": "v1"},
                      {"name": "c0", "url": "http://c0", "track": "canary", "model_version": "v2"}]},
                  {"name": "prefill", "role": "prefill", "replicas": [
                      {"name": "p1", "url": "http://p1", "track": "stable", "model_version": "v1"},
                      {"name": "p2", "url": "http://p2", "track": "canary", "model_version": "v2"}]}]})


def key_for(track_bucket_range):
    lo, hi = track_bucket_range
    return next(k for k in (f"key-{i}" for i in range(10_000)) if lo <= track_bucket(k) < hi)


def test_ejecting_a_tracks_last_replica_sends_its_traffic_to_the_other_track():
    t = canary_table()
    canary_key, stable_key = key_for((5000, 10_000)), key_for((0, 5000))
    plain = eligibility(t, model=None, sticky_key=canary_key)
    assert plain.track.name == "canary" and [r.name for r in plain.decode] == ["c0"] and plain.failover_from is None
    moved = eligibility(t, model=None, sticky_key=canary_key, ejected=frozenset({"c0"}))
    assert moved.track.name == "stable" and moved.failover_from == "canary"
    assert [r.name for r in moved.decode] == ["s0", "s1"] and [r.name for r in moved.prefill] == ["p1"]
    # one of two stable replicas ejected: the track keeps its traffic
    kept = eligibility(t, model=None, sticky_key=stable_key, ejected=frozenset({"s0"}))
    assert kept.track.name == "stable" and kept.failover_from is None and [r.name for r in kept.decode] == ["s1"]
    both = eligibility(t, model=None, sticky_key=stable_key, ejected=frozenset({"s0", "s1"}))
    assert both.track.name == "canary" and both.failover_from == "stable" and [r.name for r in both.prefill] == ["p2"]


def test_a_track_whose_replicas_were_all_tried_fails_over_and_a_503_when_every_track_is_ejected():
    t = canary_table()
    canary_key = key_for((5000, 10_000))
    # the canary's one replica failed this request before the breaker ejected it: the retry goes to stable
    retried = eligibility(t, model=None, sticky_key=canary_key, exclude=frozenset({"c0"}))
    assert retried.track.name == "stable" and retried.failover_from == "canary"
    assert [r.name for r in retried.decode] == ["s0", "s1"] and [r.name for r in retried.prefill] == ["p1"]
    with pytest.raises(NoReplicaAvailable, match=r"track 'canary'; 3 tried, 0 ejected"):
        eligibility(t, model=None, sticky_key=canary_key, exclude=frozenset({"c0", "s0", "s1"}))
    with pytest.raises(NoReplicaAvailable, match=r"track 'canary'; 0 tried, 3 ejected"):
        eligibility(t, model=None, sticky_key=canary_key, ejected=frozenset({"c0", "s0", "s1"}))


def test_the_running_failure_count_gives_the_transitions_of_counting_the_window_every_time():
    # the breaker keeps its window's failure count as outcomes come and go; a reference recounts the window each time
    import random
    from collections import deque

    rng = random.Random(5)
    for trial in range(20):
        b, clock = breaker(max_error_rate=rng.choice([0.05, 0.2, 0.5]), min_requests=rng.choice([3, 20]),
                           max_consecutive_failures=rng.choice([3, 1000]), cooldown_s=5.0, max_cooldown_s=20.0)
        c = b.config
        window: deque = deque()
        state, opened, cooldown, run = CLOSED, 0.0, 0.0, 0
        for _ in range(600):
            clock.now += rng.choice([0.0, 0.01, 0.3, 2.0])
            ok = rng.random() < rng.choice([0.5, 0.95])
            got = b.record("r0", ok)
            # the reference, as the breaker's docstring states it
            want = None
            if state == OPEN and clock.now >= opened + cooldown:
                state = HALF_OPEN
            if state == HALF_OPEN:
                if ok:
                    state, window, run = CLOSED, deque(), 0
                    want = Transition("r0", CLOSED)
                else:
                    state, opened, cooldown, window, run = OPEN, clock.now, min(cooldown * 2, c.max_cooldown_s), deque(), 0
                    want = Transition("r0", OPEN, "probe_failed", failures=1, requests=1)
            elif state == CLOSED:
                window.append((clock.now, ok))
                while window and window[0][0] <= clock.now - c.window_s:
                    window.popleft()
                run = 0 if ok else run + 1
                failures = sum(1 for _, good in window if not good)
                reason = ("consecutive_failures" if run >= c.max_consecutive_failures else "error_rate"
                          if len(window) >= c.min_requests and failures / len(window) > c.max_error_rate else None)
                if reason:
                    want = Transition("r0", OPEN, reason, failures=failures, requests=len(window))
                    state, opened, cooldown, window, run = OPEN, clock.now, c.cooldown_s, deque(), 0
            assert got == want, trial
