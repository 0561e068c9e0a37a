"""``llmd-ttl``: llm-d's KV-cache retention heuristic as published (llm-d-router PR
#2928, alpha), as a baseline: every turn of a job is soft-retained at a fixed priority
for the 0.9 quantile of a log-normal fitted to the jobs' inter-turn gaps. No admission
order and no pins: vLLM's own.

README.md beside this file has the source, the parameters and what differs.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from sidecar.framework.types import FinishInput, RetainAction, RetainDecision, StepView
from sidecar.policies.base import NativePolicy, PolicyParams, has_no_job, superseded_pins
from sidecar.policies.llmd_ttl.estimator import LogNormalGaps, SessionClock


class LlmdTtlParams(PolicyParams):
    # The directive's eviction priority (vLLM's own free blocks sit at 35).
    priority: int = Field(default=70, ge=0, le=100)
    # Quantile of the fitted gap distribution the retention lasts for, in (0, 1).
    quantile: float = Field(default=0.9, gt=0.0, lt=1.0)
    min_retention_s: float = Field(default=1.0, gt=0.0)
    max_retention_s: float = Field(default=600.0, gt=0.0)
    # Seed of the fit, in log-seconds: the CC-Bench agentic-trace fit of the SAECache
    # paper (arXiv 2605.18825), llm-d's defaults.
    initial_log_mean: float = 2.28
    initial_log_std: float = Field(default=1.34, gt=0.0)
    # Blend weight of each new window estimate.
    ema_factor: float = Field(default=0.1, gt=0.0, le=1.0)
    # Gaps in the window before the fit moves off its seed; the window's capacity.
    min_samples: int = Field(default=20, ge=2)
    window_size: int = Field(default=200, ge=2)
    # Gaps shorter than this are timestamp noise, longer ones a new session.
    min_gap_s: float = Field(default=0.1, gt=0.0)
    max_idle_s: float = Field(default=3600.0, gt=0.0)
    # Soft cap on the jobs whose last activity is kept, per engine.
    max_jobs: int = Field(default=100_000, gt=0)

    @model_validator(mode="after")
    def _bounds_ordered(self) -> LlmdTtlParams:
        if self.min_retention_s > self.max_retention_s:
            raise ValueError(f"min_retention_s {self.min_retention_s} > max_retention_s "
                             f"{self.max_retention_s}")
        if self.window_size < self.min_samples:
            raise ValueError(f"window_size {self.window_size} < min_samples "
                             f"{self.min_samples}")
        return self


class LlmdTtlPolicy(NativePolicy):
    name = "llmd-ttl"
    # The engine keeps a finished turn's blocks until the daemon's word, cached at
    # the top priority (caches_provisional_pins): the word sets their retention.
    pins_finished_requests = True
    params_model: ClassVar[type[PolicyParams]] = LlmdTtlParams
    params: LlmdTtlParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        # Per engine: one session type (every job), its fit and its jobs' clocks.
        self._gaps: dict[str, LogNormalGaps] = {}
        self._clocks: dict[str, SessionClock] = {}

    def forget_engine(self, engine_id: str) -> None:
        self._gaps.pop(engine_id, None)
        self._clocks.pop(engine_id, None)

    def engines_known(self) -> frozenset[str]:
        """The engines this policy keeps state about (what ``forget_engine`` drops)."""
        return frozenset(self._gaps)

    def caches_provisional_pins(self, step: StepView) -> bool:
        # llm-d's directive applies as the blocks are freed: none is ever held.
        return True

    def gaps(self, engine_id: str) -> LogNormalGaps:
        """The engine's gap estimator (created on first use)."""
        gaps = self._gaps.get(engine_id)
        if gaps is None:
            params = self.params
            gaps = self._gaps[engine_id] = LogNormalGaps(
                params.initial_log_mean, params.initial_log_std, params.ema_factor,
                params.min_samples, params.window_size)
            self._clocks[engine_id] = SessionClock(params.max_jobs, params.max_idle_s)
        return gaps

    def retention_s(self, engine_id: str) -> float:
        """How long a finished turn is retained: the fit's quantile, clamped."""
        params = self.params
        seconds = self.gaps(engine_id).fit().quantile_s(params.quantile)
        return min(max(seconds, params.min_retention_s), params.max_retention_s)

    def on_finish(self, finished: FinishInput) -> RetainDecision:
        superseded = superseded_pins(finished)
        request = finished.request
        if has_no_job(request):  # llm-d: no session id, no directive
            return RetainDecision.release("llmd-ttl: no job id: no retention",
                                          release_pins=superseded)
        engine_id = finished.step.engine_id
        gaps = self.gaps(engine_id)
        clock = self._clocks[engine_id]
        # The gap before this turn, measured at its finish (llm-d measures it at the
        # arrival): from the job's last activity to the turn's arrival.
        gap_s = clock.observe(request.job_id, request.arrival_s)
        if gap_s is not None and gap_s >= self.params.min_gap_s:
            gaps.observe(gap_s)
        if request.is_last_step:  # no next turn: the job's clock is done
            clock.forget(request.job_id)
            return RetainDecision.release("llmd-ttl: last step of the job",
                                          release_pins=superseded)
        job = finished.step.jobs.get(request.job_id)
        finished_at_s = (job.last_departure_s if job is not None
                         and job.last_departure_s is not None else finished.step.now_s)
        clock.touch(request.job_id, finished_at_s)
        fit = gaps.fit()
        retention_s = self.retention_s(engine_id)
        return RetainDecision(
            RetainAction.SOFT_RETAIN, ttl_s=retention_s,
            retention_priority=self.params.priority,
            reason=(f"llmd-ttl: q{self.params.quantile:g} of the gap fit (mu "
                    f"{fit.log_mean:.2f}, sigma {fit.log_std:.2f}, {fit.observed} gaps): "
                    f"cached at priority {self.params.priority} for {retention_s:.3g} s"),
            release_pins=superseded)
