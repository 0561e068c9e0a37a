"""The inter-turn gap estimator of llm-d's ``session-interturn-latency-producer``
(llm-d-router PR #2928, ``interturnlatency/lognormal.go`` and ``tracker.go``), ported.

A log-normal fitted online: a sliding window over ln(gap) gives the sample mean and
population standard deviation, blended into the running parameters with an
exponential moving average once the window holds ``min_samples`` gaps; until then the
seed is the fit. A gap is the idle time between one turn's finish and the job's next
arrival (or between two arrivals of the job); gaps below ``min_gap_s`` or above
``max_idle_s`` are discarded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

# The floor on the fitted log-std, so the fit never collapses to a point mass.
MIN_LOG_STD = 0.1


@dataclass(frozen=True, slots=True)
class GapFit:
    """A log-normal on gap seconds: ln(gap) ~ Normal(log_mean, log_std)."""

    log_mean: float
    log_std: float
    # Gaps the fit has absorbed (0: still the seed).
    observed: int

    def quantile_s(self, q: float) -> float:
        """The q-quantile of the gap in seconds, q in (0, 1): exp(mu + sigma * z_q)."""
        return math.exp(self.log_mean + self.log_std * NormalDist().inv_cdf(q))


@dataclass(slots=True)
class LogNormalGaps:
    """One session type's estimator (llm-d's ``logNormalEstimator``)."""

    log_mean: float
    log_std: float
    ema_factor: float
    min_samples: int
    window_size: int
    observed: int = 0
    _window: list[float] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self) -> None:
        self.log_std = max(self.log_std, MIN_LOG_STD)

    def observe(self, gap_s: float) -> None:
        """One gap, in seconds; a gap of 0 s or less is ignored."""
        if gap_s <= 0.0:
            return
        value = math.log(gap_s)
        if len(self._window) < self.window_size:
            self._window.append(value)
        else:  # a ring: the oldest gap gives way
            self._window[self._next] = value
        self._next = (self._next + 1) % self.window_size
        self.observed += 1
        if len(self._window) < self.min_samples:
            return
        count = len(self._window)
        mean = sum(self._window) / count
        std = math.sqrt(sum((v - mean) ** 2 for v in self._window) / count)
        self.log_mean += self.ema_factor * (mean - self.log_mean)
        self.log_std = max(self.log_std + self.ema_factor * (std - self.log_std), MIN_LOG_STD)

    def fit(self) -> GapFit:
        return GapFit(self.log_mean, self.log_std, self.observed)


@dataclass(slots=True)
class SessionClock:
    """Each job's last activity (a finish or an arrival), to measure its next gap
    (llm-d's ``sessionTracker``). A soft cap: past ``max_jobs`` jobs, those idle
    longer than ``max_idle_s`` are dropped; a new job is always taken."""

    max_jobs: int
    max_idle_s: float
    last_active_s: dict[str, float] = field(default_factory=dict)

    def observe(self, job_id: str, at_s: float) -> float | None:
        """The job arrived at ``at_s``: the gap since its last activity (None: first
        seen, no time passed, or idle past ``max_idle_s``); ``at_s`` is its activity
        now."""
        last_s = self.last_active_s.get(job_id)
        self.touch(job_id, at_s)
        if last_s is None:
            return None
        gap_s = at_s - last_s
        if gap_s <= 0.0 or gap_s > self.max_idle_s:
            return None
        return gap_s

    def touch(self, job_id: str, at_s: float) -> None:
        """Activity of the job at ``at_s`` that measures no gap (a turn finished).
        Never moves a job's clock back: a report's events may come out of order."""
        last_s = self.last_active_s.get(job_id)
        if last_s is None and len(self.last_active_s) >= self.max_jobs:
            self._sweep(at_s)
        if last_s is None or at_s > last_s:
            self.last_active_s[job_id] = at_s

    def forget(self, job_id: str) -> None:
        self.last_active_s.pop(job_id, None)

    def _sweep(self, now_s: float) -> None:
        for job_id in [j for j, last_s in self.last_active_s.items()
                       if now_s - last_s > self.max_idle_s]:
            del self.last_active_s[job_id]
