"""vLLM's own behaviour for every extension point, and helpers shared by policies.

A policy subclasses :class:`NativePolicy` and overrides the hooks where it differs
from vLLM (``sidecar.framework.protocols.Policy`` lists all seven, the three class
attributes the runtime reads, and the order of the calls); every hook it leaves alone
keeps vLLM's semantics, so a partial policy is always a complete, safe one.

Contracts (``sidecar.framework.protocols``, checked against every registered policy by
``tests/unit/test_policy_contract.py``): no I/O, no clock but the step's ``now_s``, no
randomness. A hook's answer depends on its input, the policy's parameters and, for a
policy that keeps it, the state it keeps per engine, fed by that engine's steps in
order and dropped by ``forget_engine``; so the digital twin replays a policy exactly,
and the same step seen twice gets the same answer. Orderings are total (ties broken by
request id), so two daemons given the same steps decide the same. Scratch shared by
the hooks of one step lives in ``StepView.scratch``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from sidecar.framework.types import (
    FinishInput,
    Ordering,
    PinRelease,
    PinView,
    PressureOrder,
    RequestView,
    RetainDecision,
    StepView,
    ToolTimeDistribution,
)


class PolicyParams(BaseModel):
    """Base of every policy's parameters: typed, defaulted, validated at start-up.
    Unknown names are errors (a misspelt parameter must not be silently ignored), and
    parameters are immutable once built."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, validate_default=True
    )


class NativeParams(PolicyParams):
    """vLLM's behaviour has no parameters."""


class NativePolicy:
    """vLLM's own scheduling on its priority policy, inside one client priority:
    earliest arrival admitted first, newest arrival preempted first, no pins."""

    name: str = "native"
    pins_finished_requests: bool = False
    reads_waiting_demand: bool = False
    params_model: ClassVar[type[PolicyParams]] = NativeParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.params = params if params is not None else self.params_model()
        if not isinstance(self.params, self.params_model):
            raise TypeError(f"{self.name} needs {self.params_model.__name__}, "
                            f"got {type(self.params)!r}")

    def caches_provisional_pins(self, step: StepView) -> bool:
        """Held (False) or cached at the top retention priority (True) while the
        daemon decides on a pin (vllm_plugin/provisional.py)."""
        return False

    def forget_engine(self, engine_id: str) -> None:
        """The engine left: vLLM's scheduling keeps no state per engine."""

    def order_waiting(self, step: StepView) -> Ordering:
        # vLLM's priority policy at one client priority (the engine keeps the client's
        # priority as the first key): the smallest arrival_time first.
        ordered = sorted(step.waiting, key=_arrival_key)
        return Ordering(tuple(r.request_id for r in ordered), "fcfs: earliest arrival first")

    def order_victims(self, step: StepView) -> Ordering:
        # vLLM's priority policy preempts max(running, key=(priority, arrival_time)):
        # at one client priority, the newest arrival.
        ordered = sorted(step.running, key=_arrival_key, reverse=True)
        return Ordering(
            tuple(r.request_id for r in ordered), "fcfs: newest arrival preempted first"
        )

    def on_finish(self, finished: FinishInput) -> RetainDecision:
        return RetainDecision.release(
            "fcfs: vLLM frees a finished request's blocks at once",
            release_pins=superseded_pins(finished),
        )

    def release_under_pressure(self, step: StepView) -> PinRelease:
        return PinRelease((), "")

    def order_pins_under_pressure(self, step: StepView) -> PressureOrder:
        # vLLM holds no pins: any pin gives way before a running request is
        # preempted, the one closest to expiry first.
        ordered = sorted(step.pins, key=lambda p: (p.expires_at_s, p.request_id))
        return PressureOrder(tuple(p.request_id for p in ordered), None,
                             "native: pins give way before preemption, earliest expiry first")

    def expire(self, step: StepView) -> PinRelease:
        expired = tuple(p.request_id for p in step.pins if p.expires_at_s <= step.now_s)
        return PinRelease(expired, "pin TTL expired" if expired else "")


def _arrival_key(request: RequestView) -> tuple[float, str]:
    return (request.arrival_s, request.request_id)


def has_no_job(request: RequestView) -> bool:
    """Whether a request was sent with no job id and no session: a job of one turn
    (the runtime gives it its own request id as job id, ``sidecar.jobs.effective_job_id``).
    No turn follows it, so nothing of it is worth keeping for its job: its context is
    left at vLLM's own order unless a directive asks (docs/decisions/022)."""
    return request.job_id == request.request_id


def superseded_pins(finished: FinishInput) -> tuple[str, ...]:
    """Pins of the finished request's job other than its own: a job's new finish
    replaces its older pin (Continuum's ``_free_blocks`` step 1). With concurrent
    requests of one job, each finish supersedes every earlier pin of the job, so at
    most one pin per job survives."""
    request = finished.request
    return tuple(
        pin.request_id
        for pin in finished.step.pins
        if pin.job_id == request.job_id and pin.request_id != request.request_id
    )


def job_first_arrivals(
    step: StepView, requests: Sequence[RequestView] | None = None
) -> dict[str, float]:
    """Job-level FCFS key for every job of ``requests`` (default: every request in the
    step): the job's first arrival as the tracker knows it, else (a job the runtime
    sent no view for) the earliest arrival among its requests in the whole step."""
    jobs = step.jobs
    first: dict[str, float] = {}
    unknown: set[str] = set()
    for request in requests if requests is not None else (*step.waiting, *step.running):
        job_id = request.job_id
        if job_id in first:
            continue
        known = jobs.get(job_id)
        if known is not None:
            first[job_id] = known.first_arrival_s
        else:
            unknown.add(job_id)
    if unknown:  # rare: a job the tracker lost; look at all its requests in the step
        for request in (*step.waiting, *step.running):
            if request.job_id in unknown:
                current = first.get(request.job_id)
                if current is None or request.arrival_s < current:
                    first[request.job_id] = request.arrival_s
    return first


def tool_distribution(
    tool: str | None,
    own: ToolTimeDistribution | None,
    pooled: ToolTimeDistribution | None,
    min_samples: int,
) -> tuple[ToolTimeDistribution | None, str]:
    """The tool's own distribution once it has ``min_samples`` samples, else every
    tool's samples pooled (cold start), else None; and where it came from."""
    if own is not None and own.count >= min_samples:
        return own, f"{own.count} samples of {tool!r}"
    if pooled is not None and pooled.count > 0:
        return pooled, f"all tools' {pooled.count} samples (cold start)"
    return None, "no samples"


def pinned_blocks_by_job(pins: Sequence[PinView]) -> dict[str, int]:
    blocks: dict[str, int] = {}
    for pin in pins:
        blocks[pin.job_id] = blocks.get(pin.job_id, 0) + pin.blocks
    return blocks


def blocks_to_admit(request: RequestView, block_size_tokens: int, reusable_blocks: int) -> int:
    """KV blocks a waiting request still needs to be admitted: its prompt's blocks
    minus those it can reuse (already computed, or pinned for its job and found by
    prefix caching). A lower bound: vLLM may also reserve lookahead slots."""
    if block_size_tokens <= 0:
        return 0
    prompt_blocks = math.ceil(request.prompt_tokens / block_size_tokens)
    computed_blocks = request.computed_tokens // block_size_tokens
    return max(prompt_blocks - max(computed_blocks, reusable_blocks), 0)


# Sort key of a waiting request in job-level order: (job holds no pin, job's first
# arrival, arrival, id).
WaitingKey = Callable[[RequestView], tuple[bool, float, float, str]]


def job_level_waiting_key(step: StepView) -> WaitingKey:
    """Continuum's admission order: requests whose job holds a pin first (they reuse
    it, and admitting them frees it soonest), then job-level FCFS by the job's first
    arrival, then the request's arrival."""
    first = job_first_arrivals(step, step.waiting)
    pinned_jobs = {p.job_id for p in step.pins}

    def key(request: RequestView) -> tuple[bool, float, float, str]:
        return (request.job_id not in pinned_jobs, first[request.job_id],
                request.arrival_s, request.request_id)

    return key


def job_level_victims(step: StepView) -> list[RequestView]:
    """Running requests, first to be preempted first: non-last-step before last-step
    (a last step is about to free its blocks for good, so preempting it wastes the
    most), then the newest job, then the newest request of that job."""
    first = job_first_arrivals(step, step.running)

    def key(request: RequestView) -> tuple[bool, float, float, str]:
        return (not request.is_last_step, first[request.job_id], request.arrival_s,
                request.request_id)

    return sorted(step.running, key=key, reverse=True)


def expired_unless_job_waits(step: StepView, until_s: float | None = None,
                             waiting_jobs: Collection[str] | None = None) -> tuple[str, ...]:
    """Pins whose time is up by ``until_s`` (``now_s`` unless given) and whose job
    has no request waiting (a waiting request is about to reuse its job's pin;
    ``waiting_jobs``: those jobs, when the caller has them already)."""
    if waiting_jobs is None:
        waiting_jobs = {r.job_id for r in step.waiting}
    until_s = step.now_s if until_s is None else until_s
    return tuple(p.request_id for p in step.pins
                 if p.expires_at_s <= until_s and p.job_id not in waiting_jobs)
