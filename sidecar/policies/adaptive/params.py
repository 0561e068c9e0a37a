"""``adaptive``'s parameters: typed, defaulted, validated at start-up (README.md beside
this file has the table)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from sidecar.policies.base import PolicyParams

# Seconds to prefill one token until the engine's own figure is learned: Llama-3.1-8B
# on one RTX 5090-class GPU (~9-10k prompt tokens/s).
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4


class AdaptiveParams(PolicyParams):
    # Seconds to prefill one context token: what losing a context costs. Unset: the
    # figure the daemon learns from the engine's steps (StepView.engine_cost), and
    # DEFAULT_PREFILL_S_PER_TOKEN until it is known. Set it to fix a figure.
    prefill_s_per_token: float | None = Field(default=None, ge=0.0)
    # Engine seconds that holding the whole KV cache for one second costs when the
    # waiting requests find no free block at all (scaled down with the shortage).
    memory_price: float = Field(default=1.0, ge=0.0)
    # How far ahead a pin is planned: candidate horizons; the longest is the most a
    # pin is ever kept past its tool's start (the engine also caps it, max_pin_s).
    horizons_s: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
    # Below this many samples of the tool, the distribution of all tools is used.
    min_samples: int = Field(default=5, ge=1)
    # With no sample at all: P(back within cold_start_horizon_s).
    cold_start_probability: float = Field(default=0.5, ge=0.0, le=1.0)
    cold_start_horizon_s: float = Field(default=2.0, ge=0.0)
    # Bound on waiting: a request waiting more than this multiple of its fair share
    # (the wait arrival order would give it; at least min_fair_share_s) is admitted
    # before any other, oldest first, and pins give way for it.
    fair_share_multiple: float = Field(default=1.75, gt=0.0)
    min_fair_share_s: float = Field(default=1.0, gt=0.0)
    # How far the bound widens as memory gets short: fair_share_multiple x (1 +
    # overdue_widening x price / memory_price); 1: up to twice the multiple, 0: never
    # wider (with a small multiple: a first-token tail near FCFS's for part of the
    # average, README "Tail first").
    overdue_widening: float = Field(default=1.0, ge=0.0)
    # Time constant of the average admission rate the fair share is computed from.
    admission_window_s: float = Field(default=10.0, gt=0.0)
    # Time constant of the average price of memory a pin is valued at (the larger of
    # it and the current price); 0 values pins at the current price alone.
    price_window_s: float = Field(default=10.0, ge=0.0)
    # Retention priorities of released (non-last-step) contexts: from lowest (the job
    # is unlikely back soon) to highest; vLLM's own free blocks sit at 35.
    soft_retain_lowest: int = Field(default=36, ge=0, le=100)
    soft_retain_highest: int = Field(default=90, ge=0, le=100)
    # While the daemon decides on a finished turn's pin, the engine keeps its blocks
    # cached at the top retention priority (True) instead of holding them (False).
    # "auto": cached while a tenth or more of the engine's answers land 3 or more steps
    # late; otherwise held while at least half of the recent finishes were pinned,
    # else cached (waiting.py).
    provisional_cache: bool | Literal["auto"] = "auto"
    # The engine is saturated by prefill while computing prompts takes at least this
    # share of its time (StepView.prefill_tokens_per_s x the prefill cost). Then a
    # job's age is credited to every waiting request; below it only to those that fit
    # in the free blocks. 0: every request credited; above 1: only those that fit.
    saturated_prefill_share: float = Field(default=0.4, ge=0.0)
    # The most of its job's age a waiting request of a job holding no pin is credited
    # with. Unset: the longest pin horizon (horizons_s[-1]). 0: those requests keep
    # arrival order, behind the requests of jobs holding a pin.
    job_age_credit_s: float | None = Field(default=None, ge=0.0)

    @field_validator("horizons_s")
    @classmethod
    def _horizons_positive(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value:
            raise ValueError("at least one horizon is needed")
        for horizon_s in value:
            if not horizon_s > 0.0:
                raise ValueError(f"horizons must be > 0 s, got {horizon_s!r}")
        return tuple(sorted(set(value)))

    @model_validator(mode="after")
    def _priorities_ordered(self) -> AdaptiveParams:
        if self.soft_retain_lowest > self.soft_retain_highest:
            raise ValueError(
                f"soft_retain_lowest {self.soft_retain_lowest} > soft_retain_highest "
                f"{self.soft_retain_highest}"
            )
        return self

    @property
    def longest_horizon_s(self) -> float:
        return self.horizons_s[-1]

    @property
    def credit_s(self) -> float:
        """The most of its job's age a waiting request holding no pin ranks by."""
        return self.longest_horizon_s if self.job_age_credit_s is None else self.job_age_credit_s
