"""Request length distributions and arrivals of a planning scenario.

Prompt and output lengths are log-normal, given by their median and 90th percentile:
``mu = ln(median)``, ``sigma = ln(p90 / median) / z_0.9`` with ``z_0.9 = 1.2816`` the standard normal
90% quantile (a log-normal's quantiles are ``exp(mu + sigma * z_q)``). Lengths are rounded to
integers and clipped to ``[1, cap]``. Without a p90 the length is constant (``sigma = 0``).
Arrivals are Poisson (exponential gaps of mean ``1 / rate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

Z90 = NormalDist().inv_cdf(0.9)


@dataclass(frozen=True)
class LengthDistribution:
    """A clipped log-normal token count."""

    median: int
    """Median tokens."""
    p90: int | None = None
    """90th percentile tokens; None: every length is ``median``."""
    cap: int = 131072
    """Largest length (longer draws are clipped to it)."""

    def __post_init__(self) -> None:
        if self.median < 1 or self.cap < self.median or (self.p90 is not None and self.p90 < self.median):
            raise ValueError(f"need 1 <= median <= p90 and median <= cap, got {self}")

    @property
    def sigma(self) -> float:
        """Log-space standard deviation ``ln(p90 / median) / z_0.9``."""
        return 0.0 if self.p90 is None else math.log(self.p90 / self.median) / Z90

    def _from_normal(self, z: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(self.median * np.exp(self.sigma * z)), 1, self.cap).astype(np.int64)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` lengths drawn with ``rng`` (int64)."""
        return self._from_normal(rng.standard_normal(size))

    def quantile(self, q: float) -> int:
        """The length at quantile ``q`` (0 < q < 1), clipped to ``[1, cap]``."""
        return int(self._from_normal(np.array([NormalDist().inv_cdf(q)]))[0])

    def quantile_grid(self, size: int = 2000) -> np.ndarray:
        """Lengths at the quantiles ``(i + 0.5) / size``: equal-weight points for expectations (int64)."""
        dist = NormalDist()
        z = np.array([dist.inv_cdf((i + 0.5) / size) for i in range(size)])
        return self._from_normal(z)


def poisson_arrivals(rng: np.random.Generator, rate_per_s: float, size: int) -> np.ndarray:
    """Arrival times (s) of ``size`` Poisson arrivals at ``rate_per_s``, starting at the first gap.

    Raises:
        ValueError: non-positive rate.
    """
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be positive, got {rate_per_s!r}")
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size))
