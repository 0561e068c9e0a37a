"""A log-bucket sketch of durations whose every update is a commutative increment.

Mapping (DDSketch, Masson et al., VLDB 2019): a duration ``d`` seconds goes to bucket
``ceil(log(d) / log(gamma))`` with ``gamma = (1 + a) / (1 - a)`` for a relative
accuracy ``a`` (default 2 %). A quantile read back from the buckets is within ``a`` of
the true sample quantile, relatively.

Why increments: a sample changes only sums (a count, the sums of log durations and of
their squares, and one bucket's count). Sums commute, so daemon replicas can all add
to one store hash with ``Store.hincr`` (HINCRBYFLOAT in Redis) and no update is lost,
with no read-modify-write and no lock. Every replica must use the same accuracy:
bucket indices depend on it.

Hash layout (the field names are the on-store format; change them only with a new
key version in ``sidecar.store.keys``)::

    count        number of samples
    sum_log      sum of ln(duration_s)
    sumsq_log    sum of ln(duration_s) ** 2
    b:<index>    samples in bucket <index> (an integer, may be negative)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.framework.types import ToolTimeDistribution

COUNT_FIELD = "count"
SUM_LOG_FIELD = "sum_log"
SUMSQ_LOG_FIELD = "sumsq_log"
BUCKET_PREFIX = "b:"

DEFAULT_RELATIVE_ACCURACY = 0.02
# Durations are clamped into this range before bucketing: it bounds the number of
# buckets (about 450 fields at 2 %) and keeps log() finite for a zero or negative
# sample (clock skew between an engine's departure and arrival reports).
MIN_DURATION_S = 1e-3
MAX_DURATION_S = 86_400.0


@dataclass(frozen=True, slots=True)
class LogBucketSketch:
    """The bucket mapping and field encoding; holds no samples (the store does)."""

    relative_accuracy: float = DEFAULT_RELATIVE_ACCURACY

    def __post_init__(self) -> None:
        if not 0.0 < self.relative_accuracy < 1.0:
            raise ValueError(f"relative_accuracy must be in (0, 1), got {self.relative_accuracy!r}")

    @property
    def gamma(self) -> float:
        return (1.0 + self.relative_accuracy) / (1.0 - self.relative_accuracy)

    @staticmethod
    def clamp(duration_s: float) -> float:
        if not math.isfinite(duration_s):
            return MAX_DURATION_S if duration_s > 0 else MIN_DURATION_S
        return min(max(duration_s, MIN_DURATION_S), MAX_DURATION_S)

    def bucket_index(self, duration_s: float) -> int:
        """Index ``i`` with ``gamma**(i-1) < d <= gamma**i`` (d clamped)."""
        # The small epsilon keeps exact powers of gamma in their own bucket despite
        # rounding in log(); it matches ToolTimeDistribution.probability_within.
        value = math.log(self.clamp(duration_s)) / math.log(self.gamma)
        return math.ceil(value - 1e-12)

    def increments(self, duration_s: float) -> dict[str, float]:
        """The hash increments that add one sample."""
        log_d = math.log(self.clamp(duration_s))
        return {
            COUNT_FIELD: 1.0,
            SUM_LOG_FIELD: log_d,
            SUMSQ_LOG_FIELD: log_d * log_d,
            f"{BUCKET_PREFIX}{self.bucket_index(duration_s)}": 1.0,
        }

    def distribution(self, tool: str, fields: Mapping[str, float]) -> ToolTimeDistribution | None:
        """The distribution a hash holds (as ``Store.hgetall`` returns it); None when it
        holds no sample. Unknown fields are ignored (forward compatibility)."""
        count = round(fields.get(COUNT_FIELD, 0.0))
        if count <= 0:
            return None
        buckets: dict[int, int] = {}
        for name, value in fields.items():
            if not name.startswith(BUCKET_PREFIX):
                continue
            try:
                index = int(name[len(BUCKET_PREFIX) :])
            except ValueError:
                continue
            samples = round(value)
            if samples > 0:
                buckets[index] = samples
        mean_log_s = fields.get(SUM_LOG_FIELD, 0.0) / count
        # Population variance from the raw moments; clamped because rounding can make
        # it slightly negative when every sample is equal.
        var_log_s = max(fields.get(SUMSQ_LOG_FIELD, 0.0) / count - mean_log_s * mean_log_s, 0.0)
        return ToolTimeDistribution(
            tool=tool,
            count=count,
            mean_log_s=mean_log_s,
            var_log_s=var_log_s,
            gamma=self.gamma,
            # Sorted by index: ToolTimeDistribution.quantile sorts, and sorting a
            # sorted list is linear.
            bucket_counts=dict(sorted(buckets.items())),
        )


def add_increments(fields: dict[str, float], increments: Mapping[str, float]) -> None:
    """Apply increments to an in-memory copy of a hash (what ``hincr`` does on the
    store), so a local cache can follow its own writes without a round trip."""
    for name, delta in increments.items():
        fields[name] = fields.get(name, 0.0) + delta
