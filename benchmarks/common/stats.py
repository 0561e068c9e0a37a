"""The statistics every benchmark reports with, defined once.

``percentile`` is the linear interpolation between closest ranks: numpy's default
(``numpy.percentile(method="linear")``), ``statistics.quantiles(method="inclusive")``,
R's type 7 and a spreadsheet's PERCENTILE. It is the definition a reader checking a
figure with any of those gets back; it gives the median as the median (the mean of
the middle two of an even count), is continuous in the samples, and never leaves
their range. On a handful of samples it differs from a nearest-rank percentile by up
to the gap between two neighbours, so a p99 of 20 samples is an interpolation near the
maximum, not a claim about the 99th of a hundred.

The bounds are Student's t, exact (:func:`sidecar.estimators.nig.student_t_quantile`,
the incomplete beta function inverted below 30 degrees of freedom): a benchmark pools
two to ten rounds, where an expansion around the normal is far too tight (27% at one
degree of freedom).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.estimators.nig import student_t_quantile


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, interpolated linearly between closest
    ranks (numpy's default); NaN for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def t_quantile(degrees: int, q: float) -> float:
    """Student's t ``q`` quantile at ``degrees`` degrees of freedom; infinite below one
    degree (one round bounds nothing)."""
    if degrees < 1:
        return math.inf
    return student_t_quantile(float(degrees), q)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Mean over paired rounds, its standard error and one-sided 95% upper bound."""

    mean: float
    stderr: float
    rounds: int

    @property
    def upper95(self) -> float:
        return self.mean + t_quantile(self.rounds - 1, 0.95) * self.stderr


def estimate(values: Sequence[float]) -> Estimate:
    """The mean of paired rounds' figures with its standard error (infinite for one)."""
    if not values:
        raise ValueError("no paired rounds to estimate from")
    stderr = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else math.inf
    return Estimate(statistics.mean(values), stderr, len(values))
