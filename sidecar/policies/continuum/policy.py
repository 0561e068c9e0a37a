"""``continuum``: Continuum's job-aware scheduling and TTL pinning (arXiv 2511.02230),
with the semantics of its released code (``vllm-continuum``) and without its crashes.

See README.md beside this file for the rules, the TTL formulas and the parameters.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from sidecar.framework.types import (
    FinishInput,
    Ordering,
    PinRelease,
    PressureOrder,
    RetainDecision,
    StepView,
)
from sidecar.policies.base import (
    NativePolicy,
    PolicyParams,
    blocks_to_admit,
    expired_unless_job_waits,
    has_no_job,
    job_level_victims,
    job_level_waiting_key,
    pinned_blocks_by_job,
    superseded_pins,
    tool_distribution,
)


class ContinuumParams(PolicyParams):
    # "fixed": the released code (FIXED_THRESHOLD_CONTINUUM); "cdf": the paper.
    ttl_mode: Literal["fixed", "cdf"] = "fixed"
    # Pins shorter than this are not taken (the released code's ``length_of_pin > 0.01``).
    min_pin_ttl_s: float = Field(default=0.01, ge=0.0)

    # --- fixed mode: mean tool time <= fixed_threshold_s -> pin fixed_ttl_s, else none.
    fixed_ttl_s: float = Field(default=2.0, ge=0.0)
    fixed_threshold_s: float = Field(default=2.0, ge=0.0)
    # A tool with no measured time yet is pinned (the released code's estimate is 0 s
    # before the first measurement: its verification log pins ``ls`` on first call).
    pin_unmeasured_tools: bool = True

    # --- cdf mode: tau* = argmax_tau P(tool time <= tau) * benefit_s - cost_s(tau).
    # Seconds to prefill one context token: benefit_s = context tokens * this.
    # Default: Llama-3.1-8B on one RTX 5090-class GPU, ~10k prompt tokens/s.
    prefill_s_per_token: float = Field(default=1e-4, ge=0.0)
    # Seconds of benefit that holding the whole KV cache for one second costs:
    # cost_s(tau) = (blocks / total_blocks) * tau * memory_price.
    memory_price: float = Field(default=1.0, ge=0.0)
    # Candidate TTLs are these quantiles of the tool-time distribution.
    candidate_quantiles: tuple[float, ...] = (0.5, 0.75, 0.9, 0.95, 0.99)
    # Below this many samples of the tool, the distribution of all tools is used.
    min_samples: int = Field(default=5, ge=1)
    # No pin longer than this, whatever the distribution says.
    max_ttl_s: float = Field(default=30.0, gt=0.0)

    @field_validator("candidate_quantiles")
    @classmethod
    def _quantiles_in_range(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value:
            raise ValueError("at least one candidate quantile is needed")
        for q in value:
            if not 0.0 < q <= 1.0:
                raise ValueError(f"quantiles must be in (0, 1], got {q!r}")
        return tuple(sorted(set(value)))


class ContinuumPolicy(NativePolicy):
    name = "continuum"
    pins_finished_requests = True
    params_model: ClassVar[type[PolicyParams]] = ContinuumParams
    params: ContinuumParams

    # --- admission: pinned jobs first, then job-level FCFS -------------------------

    def order_waiting(self, step: StepView) -> Ordering:
        ordered = sorted(step.waiting, key=job_level_waiting_key(step))
        return Ordering(
            tuple(r.request_id for r in ordered),
            "continuum: jobs holding a pin first, then earliest job first arrival",
        )

    # --- preemption: newest non-last-step job first, else newest job --------------

    def order_victims(self, step: StepView) -> Ordering:
        return Ordering(
            tuple(r.request_id for r in job_level_victims(step)),
            "continuum: newest non-last-step job preempted first, then newest job",
        )

    # --- steal a pin when at most one request runs --------------------------------

    def release_under_pressure(self, step: StepView) -> PinRelease:
        """Continuum steals the pin with the latest expiry when it must preempt while
        at most one request runs (preempting the last runner would stall the engine).

        Here, with at most one request running and pins held, the shortfall is what
        the next request to admit (this policy's first waiting request) needs beyond
        the free blocks; with no request waiting and one running, one block when none
        is free (its next token needs one). Pins are released latest expiry first
        until their blocks cover the shortfall. Pins of the next request's own job
        are kept: it reuses them, so freeing them would not help it."""
        if len(step.running) > 1 or not step.pins:
            return PinRelease((), "")
        pinned_blocks = pinned_blocks_by_job(step.pins)
        head_job: str | None = None
        if step.waiting:
            head = min(step.waiting, key=job_level_waiting_key(step))
            head_job = head.job_id
            need = blocks_to_admit(head, step.kv.block_size_tokens, pinned_blocks.get(head_job, 0))
            shortfall = need - step.kv.free_blocks
            if not step.running and step.kv.admission_stalled:
                # Nothing runs and the engine failed to admit the waiting requests
                # (vLLM also keeps a watermark the estimate cannot see). Without a
                # steal the engine idles until a TTL ends: take at least one pin.
                shortfall = max(shortfall, 1)
        elif step.running and step.kv.free_blocks <= 0:
            shortfall = 1
        else:
            shortfall = 0
        if shortfall <= 0:
            return PinRelease((), "")
        candidates = sorted(
            (p for p in step.pins if p.job_id != head_job),
            key=lambda p: (p.expires_at_s, p.pinned_at_s, p.request_id),
            reverse=True,
        )
        stolen: list[str] = []
        freed = 0
        for pin in candidates:
            if freed >= shortfall:
                break
            stolen.append(pin.request_id)
            freed += pin.blocks
        return PinRelease(
            tuple(stolen),
            f"continuum: <=1 running and {shortfall} blocks short: steal pins, latest expiry first"
            if stolen
            else "",
        )

    def order_pins_under_pressure(self, step: StepView) -> PressureOrder:
        """Continuum breaks a pin on a failed allocation only when at most one request
        runs (``pop_running_request_based_on_last_step``): latest expiry first.
        Otherwise it preempts a running request and keeps every pin."""
        ordered = sorted(step.pins, key=lambda p: (p.expires_at_s, p.request_id), reverse=True)
        return PressureOrder(tuple(p.request_id for p in ordered), 1,
                             "continuum: steal pins only while <=1 runs, latest expiry first")

    # --- expiry: TTL over and no request of the job waiting -----------------------

    def expire(self, step: StepView) -> PinRelease:
        expired = expired_unless_job_waits(step)
        return PinRelease(
            expired, "continuum: TTL over and no request of the job waiting" if expired else ""
        )

    # --- finish: pin non-last steps for a TTL, replacing the job's older pin -------

    def on_finish(self, finished: FinishInput) -> RetainDecision:
        superseded = superseded_pins(finished)
        if finished.request.is_last_step:
            return RetainDecision.release(
                f"{self.name}: last step of the job", release_pins=superseded
            )
        if has_no_job(finished.request):
            # A tool call parsed from a one-shot answer does not bring it back.
            return RetainDecision.release(
                f"{self.name}: no job id: a job of one turn", release_pins=superseded
            )
        ttl_s, reason = self.pin_ttl_s(finished)
        if ttl_s is None or ttl_s <= self.params.min_pin_ttl_s:
            return RetainDecision.release(reason, release_pins=superseded)
        return RetainDecision.pin(ttl_s, reason, release_pins=superseded)

    def pin_ttl_s(self, finished: FinishInput) -> tuple[float | None, str]:
        """TTL to pin a non-last-step finish for (None: do not pin) and why.
        The extension point subclasses override (ContextServe)."""
        if finished.tool is None:
            return None, f"{self.name}: no tool call detected"
        if self.params.ttl_mode == "fixed":
            return self._fixed_ttl_s(finished)
        return self._cdf_ttl_s(finished)

    def _fixed_ttl_s(self, finished: FinishInput) -> tuple[float | None, str]:
        params = self.params
        times = finished.tool_times
        if times is None or times.count == 0:
            if params.pin_unmeasured_tools:
                return params.fixed_ttl_s, (
                    f"{self.name} fixed: {finished.tool!r} not measured yet: "
                    f"pin {params.fixed_ttl_s:g} s"
                )
            return None, f"{self.name} fixed: {finished.tool!r} not measured yet"
        mean_s = times.mean_s
        if mean_s > params.fixed_threshold_s:
            return None, (
                f"{self.name} fixed: mean time of {finished.tool!r} {mean_s:.3g} s > "
                f"{params.fixed_threshold_s:g} s"
            )
        return params.fixed_ttl_s, (
            f"{self.name} fixed: mean time of {finished.tool!r} {mean_s:.3g} s <= "
            f"{params.fixed_threshold_s:g} s: pin {params.fixed_ttl_s:g} s"
        )

    def _cdf_ttl_s(self, finished: FinishInput) -> tuple[float | None, str]:
        params = self.params
        times, source = tool_distribution(finished.tool, finished.tool_times,
                                          finished.global_tool_times, params.min_samples)
        if times is None:
            return None, f"{self.name} cdf: no tool-time samples yet"
        context_tokens = finished.request.prompt_tokens + finished.output_tokens
        benefit_s = context_tokens * params.prefill_s_per_token
        total_blocks = finished.step.kv.total_blocks
        memory_share = finished.blocks / total_blocks if total_blocks > 0 else 0.0
        best_ttl_s = 0.0
        best_value_s = 0.0  # not pinning: no benefit, no cost
        for q in params.candidate_quantiles:
            ttl_s = min(times.quantile(q), params.max_ttl_s)
            value_s = (
                times.probability_within(ttl_s) * benefit_s
                - memory_share * ttl_s * params.memory_price
            )
            if value_s > best_value_s:
                best_ttl_s, best_value_s = ttl_s, value_s
        if best_value_s <= 0.0:
            return None, (
                f"{self.name} cdf: no TTL repays its memory (benefit {benefit_s:.3g} s, {source})"
            )
        return best_ttl_s, (
            f"{self.name} cdf: tau*={best_ttl_s:.3g} s maximises "
            f"P*{benefit_s:.3g} s - cost ({source})"
        )
