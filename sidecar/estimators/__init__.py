"""Tool-time estimation: a mergeable log-bucket sketch (stored with commutative
increments), a Normal-Inverse-Gamma posterior on log durations, and the store-backed
estimator the runtime feeds with measured tool times.

``sketch`` and ``nig`` are pure (policies use them); ``tool_time.ToolTimeEstimator``
talks to the store and is for the runtime only: policies receive its distributions
through ``FinishInput``.
"""

from sidecar.estimators.nig import NigPosterior, NigPrior, student_t_quantile
from sidecar.estimators.sketch import DEFAULT_RELATIVE_ACCURACY, LogBucketSketch

__all__ = [
    "DEFAULT_RELATIVE_ACCURACY",
    "LogBucketSketch",
    "NigPosterior",
    "NigPrior",
    "student_t_quantile",
]
