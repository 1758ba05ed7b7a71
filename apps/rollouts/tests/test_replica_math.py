"""Replica math: the canary split, the R=1 rule, surge-limited moves and the weight actually applied."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.rollouts.replica_math import ReplicaMathError, applied_weight, canary_split, next_replicas


@pytest.mark.parametrize(
    ("total", "weight", "surge", "expected"),
    [
        (3, 33, 1, (1, 2)),
        (10, 50, 1, (5, 5)),
        (10, 10, 0, (1, 9)),
        (4, 100, 0, (4, 0)),
        (4, 0, 1, (0, 4)),
        (1, 10, 1, (1, 1)),  # the R=1 rule: surge one canary, stable keeps its replica
        (10, 95, 1, (10, 1)),  # ceil(9.5) = 10 canaries would leave stable empty: it keeps one
        (0, 50, 1, (0, 0)),
    ],
)
def test_canary_split(total, weight, surge, expected):
    assert canary_split(total, weight, max_surge=surge) == expected


def test_r1_w10_without_surge_is_refused_with_a_message():
    with pytest.raises(ReplicaMathError) as exc:
        canary_split(1, 10, max_surge=0)
    assert str(exc.value) == ("weight 10% on 1 replica(s) needs 1 canary replica(s), leaving none for the 90% of "
                              "traffic that stays on stable; set max_surge >= 1 (one extra stable replica) or use "
                              "weight 100.")


def _walk(total, surge, start, target):
    """Move until target, every desired replica becoming ready before the next move; the moves."""
    desired, seen = dict(start), []
    for _ in range(4 * (total + 2) + 10):
        desired = next_replicas(desired=desired, ready=desired, target=target, total=total, max_surge=surge)
        seen.append(desired)
        if desired == target:
            return seen
    raise AssertionError(f"no convergence: {seen}")


def test_move_3_to_33_percent_with_surge_1_never_exceeds_4():
    seen = _walk(3, 1, {"stable": 3, "canary": 0}, {"stable": 2, "canary": 1})
    assert seen == [{"stable": 3, "canary": 1}, {"stable": 2, "canary": 1}]


def test_move_with_zero_surge_removes_one_stable_first():
    seen = _walk(2, 0, {"stable": 2, "canary": 0}, {"stable": 1, "canary": 1})
    assert seen == [{"stable": 1, "canary": 0}, {"stable": 1, "canary": 1}]


def test_shrinking_waits_for_ready_replicas():
    # canary desired but not ready yet: stable may not shrink
    out = next_replicas(desired={"stable": 3, "canary": 1}, ready={"stable": 3, "canary": 0},
                        target={"stable": 2, "canary": 1}, total=3, max_surge=1)
    assert out == {"stable": 3, "canary": 1}


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 12), surge=st.integers(0, 3), w0=st.integers(0, 100), w1=st.integers(0, 100))
def test_total_never_exceeds_r_plus_max_surge(total, surge, w0, w1):
    try:
        c0, s0 = canary_split(total, w0, max_surge=max(surge, 1))
        c1, s1 = canary_split(total, w1, max_surge=surge)
    except ReplicaMathError:
        return
    if c0 + s0 > total + surge:
        return  # the start itself needs more surge than this plan has
    target = {"stable": s1, "canary": c1}
    for step in _walk(total, surge, {"stable": s0, "canary": c0}, target):
        assert sum(step.values()) <= total + surge


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"weight": 50, "previous": 0, "shares": {"d": (0, 1)}, "skew": 0, "serving_ready": 0}, 0),
        ({"weight": 50, "previous": 0, "shares": {"d": (1, 1), "p": (1, 1)}, "skew": 0, "serving_ready": 1}, 50),
        ({"weight": 50, "previous": 0, "shares": {"d": (1, 1), "p": (0, 1)}, "skew": 0, "serving_ready": 1}, 0),
        ({"weight": 50, "previous": 0, "shares": {"d": (1, 1), "p": (0, 1)}, "skew": 20, "serving_ready": 1}, 20),
        ({"weight": 60, "previous": 0, "shares": {"d": (2, 4), "p": (4, 4)}, "skew": 0, "serving_ready": 2}, 30),
        ({"weight": 10, "previous": 50, "shares": {"d": (0, 1)}, "skew": 0, "serving_ready": 1}, 10),
        ({"weight": 80, "previous": 40, "shares": {"d": (1, 4)}, "skew": 0, "serving_ready": 1}, 40),
    ],
)
def test_applied_weight(kwargs, expected):
    assert applied_weight(**kwargs) == expected


@pytest.mark.parametrize(
    ("desired", "ready", "target", "total", "surge", "expected"),
    [
        # a canary that never became ready, reverting (issue 20: it kept its replica for good)
        ({"stable": 1, "canary": 1}, {"stable": 1, "canary": 0}, {"stable": 1, "canary": 0}, 1, 1,
         {"stable": 1, "canary": 0}),
        ({"stable": 2, "canary": 3}, {"stable": 2, "canary": 0}, {"stable": 3, "canary": 0}, 3, 1,
         {"stable": 2, "canary": 0}),  # no surge room this move: stable grows on the next one
        # one of three canaries ready: the two unready go now, the ready one once stable has a ready spare
        ({"stable": 1, "canary": 3}, {"stable": 1, "canary": 1}, {"stable": 3, "canary": 0}, 3, 1,
         {"stable": 1, "canary": 1}),
        # growing canary: an unready stable replica goes before the ready ones are counted
        ({"stable": 3, "canary": 1}, {"stable": 2, "canary": 1}, {"stable": 2, "canary": 1}, 3, 0,
         {"stable": 2, "canary": 1}),
    ],
)
def test_an_unready_replica_is_the_first_to_go(desired, ready, target, total, surge, expected):
    assert next_replicas(desired=desired, ready=ready, target=target, total=total, max_surge=surge) == expected


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 8), surge=st.integers(0, 2), d=st.tuples(*[st.integers(0, 9)] * 2),
       r=st.tuples(*[st.integers(0, 9)] * 2), t=st.tuples(*[st.integers(0, 9)] * 2))
def test_a_move_never_drops_ready_capacity_below_the_target_or_keeps_an_unready_surplus(total, surge, d, r, t):
    names = ("canary", "stable")
    desired, ready, target = (dict(zip(names, v, strict=True)) for v in (d, r, t))
    out = next_replicas(desired=desired, ready=ready, target=target, total=total, max_surge=surge)
    ready_before = sum(min(ready[n], desired[n]) for n in names)
    ready_after = sum(min(ready[n], out[n]) for n in names)
    unavailable = 1 if surge == 0 else 0  # Kubernetes' maxUnavailable = 1 when maxSurge = 0
    assert ready_after >= min(ready_before, total, sum(target.values())) - unavailable
    for n in names:
        if desired[n] > target[n]:  # shrinking: no unready replica above the target survives the move
            assert out[n] <= max(target[n], min(ready[n], desired[n]))
