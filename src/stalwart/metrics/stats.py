"""Small statistics for the report: percentiles and MTBF with a confidence interval.

Why hand-written: the only tools needed are a type-7 percentile (numpy's default, so
the numbers match what users compute themselves) and chi-square quantiles for even
degrees of freedom, which have a closed form through the Poisson distribution. That
keeps scipy out of the dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Distribution",
    "MtbfEstimate",
    "chi2_quantile_even",
    "distribution",
    "mtbf",
    "percentile",
]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation (numpy's ``linear``)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


@dataclass(frozen=True)
class Distribution:
    n: int
    p50: float | None
    p95: float | None
    max: float | None
    mean: float | None


def distribution(values: Sequence[float]) -> Distribution:
    if not values:
        return Distribution(0, None, None, None, None)
    return Distribution(
        len(values),
        percentile(values, 50),
        percentile(values, 95),
        max(values),
        math.fsum(values) / len(values),
    )


def _chi2_cdf_even(x: float, dof: int) -> float:
    # P(chi2_{2k} <= x) = P(Poisson(x/2) >= k) = 1 - sum_{i<k} e^{-x/2} (x/2)^i / i!
    k = dof // 2
    if x <= 0:
        return 0.0
    lam = x / 2
    logs = [-lam + i * math.log(lam) - math.lgamma(i + 1) for i in range(k)]
    top = max(logs)
    tail = math.exp(top) * math.fsum(math.exp(v - top) for v in logs)
    return max(0.0, min(1.0, 1.0 - tail))


def chi2_quantile_even(p: float, dof: int) -> float:
    """Quantile of the chi-square distribution with an even, positive ``dof``."""
    if dof <= 0 or dof % 2:
        raise ValueError(f"dof must be even and positive, got {dof}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = 0.0, max(1.0, 2.0 * dof)
    while _chi2_cdf_even(hi, dof) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if _chi2_cdf_even(mid, dof) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


@dataclass(frozen=True)
class MtbfEstimate:
    failures: int
    exposure_s: float
    mtbf_s: float | None  # None: no failure observed
    lower_s: float | None
    upper_s: float | None  # None: unbounded (no failure observed)
    confidence: float


def mtbf(failures: int, exposure_s: float, confidence: float = 0.9) -> MtbfEstimate:
    """Observed MTBF with a two-sided chi-square interval (time-terminated observation).

    Failures of a constant-rate process in a fixed time ``T`` are Poisson, so
    ``[2T / chi2((1+c)/2, 2n+2), 2T / chi2((1-c)/2, 2n)]`` covers the true MTBF with
    probability ``c``; with no failure only the lower bound exists. This is what makes a
    run with two failures say "somewhere between x and y", not a falsely precise mean.
    """
    if exposure_s <= 0:
        return MtbfEstimate(failures, exposure_s, None, None, None, confidence)
    two_t = 2.0 * exposure_s
    lower = two_t / chi2_quantile_even((1 + confidence) / 2, 2 * failures + 2)
    if failures == 0:
        return MtbfEstimate(0, exposure_s, None, lower, None, confidence)
    upper = two_t / chi2_quantile_even((1 - confidence) / 2, 2 * failures)
    return MtbfEstimate(failures, exposure_s, exposure_s / failures, lower, upper, confidence)
