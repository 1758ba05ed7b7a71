"""Pure time-series math with Prometheus' semantics: counter increase/rate and histogram quantiles.

The direct-scrape source computes signals from samples it keeps itself; these functions make
those figures agree with what Prometheus returns for the same PromQL (``increase``, ``rate``,
``histogram_quantile``), so a signal means the same thing whichever source produced it.

Conventions:

- A sample is ``(timestamp_s, value)``; timestamps are seconds (float, any epoch).
- A range ``(start_s, end_s]`` is left-open like a PromQL range selector.
- "No data" is ``None``. Empty input, too few samples, NaN and infinities all give ``None``,
  never ``0``: a signal with no data must not look like a healthy zero. ``None`` says only that
  this figure has no value; it does not say why. A quantile over a window in which no request
  finished is ``None`` both when the pool is idle and when its source cannot be read: a consumer
  that must tell them apart reads the request rate from the same source (a counter rate, which
  is a real ``0`` when the counters answered and did not move). The autoscaler does so
  (``apps.operations.autoscale_math``: idle throughout the scale-down window -> scale toward min).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Sample = tuple[float, float]


def finite_or_none(value: float | None) -> float | None:
    """Return ``value`` as a float if it is finite, else ``None`` (the "no data" value)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def samples_in_range(samples: Iterable[Sample], start_s: float, end_s: float) -> list[Sample]:
    """Samples with ``start_s < t <= end_s`` in time order (PromQL's left-open range)."""
    return sorted((s for s in samples if start_s < s[0] <= end_s), key=lambda s: s[0])


def raw_counter_increase(samples: Sequence[Sample]) -> float:
    """Increase of a counter across time-ordered ``samples`` with reset handling, no extrapolation.

    A drop in value is a counter reset (the process restarted and counted again from 0): the
    value before the drop is added back, so a restart never yields a negative increase. This is
    Prometheus' reset rule (promql/functions.go, ``extrapolatedRate``). Needs >= 1 sample; NaN
    values propagate (the caller maps NaN to "no data").
    """
    if not samples:
        raise ValueError("raw_counter_increase needs at least one sample")
    result = samples[-1][1] - samples[0][1]
    previous = samples[0][1]
    for _, value in samples[1:]:
        if value < previous:
            result += previous
        previous = value
    return result


def _extrapolated(samples: Iterable[Sample], start_s: float, end_s: float, *, is_rate: bool) -> float | None:
    """Prometheus' ``extrapolatedRate`` for counters over ``(start_s, end_s]``.

    Algorithm (Prometheus 2.x, promql/functions.go): take the reset-corrected increase between
    the first and last sample in the range; extend it linearly towards the range edges, but
    only up to half an average sample interval when the series starts or ends more than 1.1
    intervals from an edge (it began or vanished inside the range), and never past the point
    where the counter would have been zero. ``rate`` divides by the range length.
    """
    if end_s <= start_s:
        raise ValueError(f"range end {end_s} must be after its start {start_s}")
    points = samples_in_range(samples, start_s, end_s)
    if len(points) < 2:
        return None
    result = raw_counter_increase(points)
    first_t, first_v = points[0]
    last_t = points[-1][0]
    sampled_interval = last_t - first_t
    if sampled_interval <= 0:
        return None
    average_interval = sampled_interval / (len(points) - 1)
    threshold = average_interval * 1.1
    to_start = first_t - start_s
    to_end = end_s - last_t
    if to_start >= threshold:
        to_start = average_interval / 2
    if result > 0 and first_v >= 0:
        to_zero = sampled_interval * (first_v / result)
        if to_zero < to_start:
            to_start = to_zero
    if to_end >= threshold:
        to_end = average_interval / 2
    factor = (sampled_interval + to_start + to_end) / sampled_interval
    if is_rate:
        factor /= end_s - start_s
    return finite_or_none(result * factor)


def counter_increase(samples: Iterable[Sample], start_s: float, end_s: float) -> float | None:
    """PromQL ``increase(counter[end-start])`` evaluated at ``end_s``; ``None`` with < 2 samples.

    Units: the counter's units. Raises ``ValueError`` if ``end_s <= start_s``.
    """
    return _extrapolated(samples, start_s, end_s, is_rate=False)


def counter_rate(samples: Iterable[Sample], start_s: float, end_s: float) -> float | None:
    """PromQL ``rate(counter[end-start])`` at ``end_s``: per-second average; ``None`` with < 2 samples.

    Units: the counter's units per second. Raises ``ValueError`` if ``end_s <= start_s``.
    """
    return _extrapolated(samples, start_s, end_s, is_rate=True)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Quantile ``q`` from cumulative histogram buckets, as PromQL ``histogram_quantile``.

    ``buckets`` are ``(upper_bound, cumulative_count)`` pairs (the ``le`` label and its value,
    counts or rates); they must include the ``+Inf`` bucket. Algorithm (Prometheus
    promql/quantile.go, ``bucketQuantile``): sort by bound, merge equal bounds, force counts to
    be non-decreasing, find the first bucket whose count reaches ``rank = q * total`` and
    interpolate linearly inside it, assuming the lowest bucket starts at 0 (when its bound is
    positive). A rank that falls into the ``+Inf`` bucket returns the highest finite bound.

    Returns ``None`` (no data) with no ``+Inf`` bucket, fewer than two buckets, zero or NaN
    observations. Raises ``ValueError`` unless ``0 <= q <= 1``.
    """
    if not (0.0 <= q <= 1.0):
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    merged: dict[float, float] = {}
    for bound, count in buckets:
        merged[float(bound)] = merged.get(float(bound), 0.0) + float(count)
    ordered = sorted(merged.items())
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][0] < 0:
        return None
    counts: list[float] = []
    running_max = -math.inf
    for _, count in ordered:
        running_max = max(running_max, count) if not math.isnan(count) else count
        counts.append(running_max)
    observations = counts[-1]
    if math.isnan(observations) or observations == 0:
        return None
    rank = q * observations
    index = next((i for i in range(len(ordered) - 1) if counts[i] >= rank), len(ordered) - 1)
    if index == len(ordered) - 1:
        return finite_or_none(ordered[-2][0])
    if index == 0 and ordered[0][0] <= 0:
        return finite_or_none(ordered[0][0])
    bucket_start = 0.0
    bucket_end = ordered[index][0]
    count = counts[index]
    if index > 0:
        bucket_start = ordered[index - 1][0]
        count -= counts[index - 1]
        rank -= counts[index - 1]
    if count == 0:
        return finite_or_none(bucket_start)
    return finite_or_none(bucket_start + (bucket_end - bucket_start) * (rank / count))


def safe_ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` or ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return finite_or_none(numerator / denominator)
