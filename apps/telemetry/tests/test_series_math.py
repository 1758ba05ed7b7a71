"""Table-driven tests of the Prometheus-compatible counter and histogram math."""

import math

import pytest

from apps.telemetry.series_math import (
    counter_increase,
    counter_rate,
    histogram_quantile,
    raw_counter_increase,
    safe_ratio,
)

NAN = float("nan")
INF = float("inf")


def ramp(start_t, values, step=1.0):
    return [(start_t + i * step, float(v)) for i, v in enumerate(values)]


@pytest.mark.parametrize(
    ("case", "samples", "start", "end", "increase", "rate"),
    [
        # Samples cover the range; the counter starts at 0, so no extrapolation past zero.
        ("steady ramp from zero", ramp(1, range(10)), 0.0, 10.0, 9.0, 0.9),
        # Reset 20 -> 5 adds 20 back: raw 15 + 20 = 35; extrapolated 1 s towards the start
        # (to-zero bound 4*10/35 = 1.14 s is not shorter): 35 * 5/4 = 43.75, rate /5 s.
        ("counter reset mid-window", ramp(1, [10, 20, 5, 15, 25]), 0.0, 5.0, 43.75, 8.75),
        # A restart to a lower value is never negative: 100 -> 3 is an increase of 3 (+ extrapolation).
        # raw 3, extrapolated 0.5 s to the start: 3 * 1.5 / 1 = 4.5 over a 1.5 s range.
        ("reset to lower value", [(1.0, 100.0), (2.0, 3.0)], 0.5, 2.0, 4.5, 3.0),
        # Series appears mid-range: extrapolate half an interval at the end, none before a zero start.
        ("series starts inside range", ramp(30, range(11)), 0.0, 60.0, 10.5, 0.175),
        ("empty series", [], 0.0, 10.0, None, None),
        ("single sample", [(5.0, 3.0)], 0.0, 10.0, None, None),
        ("samples outside the range", ramp(20, range(5)), 0.0, 10.0, None, None),
        ("NaN last sample", [(1.0, 1.0), (2.0, 2.0), (3.0, NAN)], 0.0, 3.0, None, None),
        ("NaN first sample", [(1.0, NAN), (2.0, 2.0), (3.0, 5.0)], 0.0, 3.0, None, None),
        # As in Prometheus a NaN between two numbers takes no part in reset detection: raw 4,
        # extrapolated to the zero point 2 * 1/4 = 0.5 s before the first sample: 4 * 2.5 / 2.
        ("NaN inside the window", [(1.0, 1.0), (2.0, NAN), (3.0, 5.0)], 0.0, 3.0, 5.0, 5.0 / 3.0),
        ("flat counter", ramp(1, [7, 7, 7, 7]), 0.0, 4.0, 0.0, 0.0),
    ],
)
def test_counter_increase_and_rate_follow_prometheus(case, samples, start, end, increase, rate):
    got_increase = counter_increase(samples, start, end)
    got_rate = counter_rate(samples, start, end)
    if increase is None:
        assert got_increase is None and got_rate is None, case
    else:
        assert got_increase == pytest.approx(increase, abs=1e-12), case
        assert got_rate == pytest.approx(rate, abs=1e-12), case


def test_range_start_is_exclusive_and_end_inclusive():
    samples = [(0.0, 100.0), (1.0, 1.0), (2.0, 2.0)]
    # The sample at t=0 is outside (0, 2]; with it the reset would add 100.
    assert counter_increase(samples, 0.0, 2.0) == pytest.approx(2.0)


def test_raw_increase_adds_back_every_reset():
    assert raw_counter_increase([(0, 5.0), (1, 2.0), (2, 9.0), (3, 1.0), (4, 4.0)]) == 4.0 - 5.0 + 5.0 + 9.0
    with pytest.raises(ValueError, match="at least one sample"):
        raw_counter_increase([])


def test_inverted_range_is_rejected():
    with pytest.raises(ValueError, match="must be after its start"):
        counter_rate([(1.0, 1.0), (2.0, 2.0)], 5.0, 5.0)


BUCKETS = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]


@pytest.mark.parametrize(
    ("case", "q", "buckets", "expected"),
    [
        # rank 20 lands in (0.1, 0.5]: 0.1 + 0.4 * (20 - 10) / 20
        ("median interpolates inside its bucket", 0.5, BUCKETS, 0.3),
        # rank 39.6 lands in (0.5, 1.0]: 0.5 + 0.5 * 9.6 / 10
        ("p99", 0.99, BUCKETS, 0.98),
        # rank 4 lands in the first bucket, which starts at 0: 0.1 * 4 / 10
        ("lowest bucket starts at zero", 0.1, BUCKETS, 0.04),
        ("p100 is the top of the last finite bucket reached", 1.0, BUCKETS, 1.0),
        ("rank in +Inf bucket returns highest finite bound", 0.5, [(0.1, 1.0), (INF, 10.0)], 0.1),
        ("unsorted input is sorted", 0.5, list(reversed(BUCKETS)), 0.3),
        # counts 5, 3 (fixed to 5), 10: rank 5 is reached in the first bucket: 0.1 * 5 / 5
        ("non-monotonic counts are forced up", 0.5, [(0.1, 5.0), (0.5, 3.0), (INF, 10.0)], 0.1),
        ("negative first bound is returned as is", 0.1, [(-1.0, 5.0), (INF, 10.0)], -1.0),
        ("no +Inf bucket", 0.5, [(0.1, 1.0), (0.5, 2.0)], None),
        ("only the +Inf bucket", 0.5, [(INF, 10.0)], None),
        ("zero observations", 0.5, [(0.1, 0.0), (INF, 0.0)], None),
        ("NaN observations", 0.5, [(0.1, 1.0), (INF, NAN)], None),
        ("empty", 0.5, [], None),
        ("duplicate bounds are merged", 0.5, [(0.1, 5.0), (0.1, 5.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)], 0.3),
    ],
)
def test_histogram_quantile_matches_hand_computed_values(case, q, buckets, expected):
    got = histogram_quantile(q, buckets)
    if expected is None:
        assert got is None, case
    else:
        assert got == pytest.approx(expected, abs=1e-12), case


@pytest.mark.parametrize("q", [-0.1, 1.5, NAN])
def test_histogram_quantile_rejects_quantiles_outside_unit_interval(q):
    with pytest.raises(ValueError, match="quantile must be within"):
        histogram_quantile(q, BUCKETS)


@pytest.mark.parametrize(
    ("num", "den", "expected"),
    [(1.0, 4.0, 0.25), (0.0, 4.0, 0.0), (1.0, 0.0, None), (None, 4.0, None), (1.0, None, None), (NAN, 1.0, None)],
)
def test_safe_ratio_treats_missing_and_zero_denominator_as_no_data(num, den, expected):
    assert safe_ratio(num, den) == expected or (expected is None and safe_ratio(num, den) is None)
    assert not (expected is not None and math.isnan(safe_ratio(num, den)))
