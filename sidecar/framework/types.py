"""Plain, frozen data that flows into and out of policies.

Contract: nothing in this module (or anywhere under ``sidecar.framework``) imports
gRPC, Redis or the runtime. Policies receive these values from the runtime and
return these values to it; they never reach for the store or the network.

Times are seconds on the *engine's* clock (``now_s``), as carried by each step
report, never the daemon's wall clock: that keeps decisions deterministic in the
digital twin and correct when the engine and daemon clocks disagree.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

_Value = TypeVar("_Value")


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"


@dataclass(frozen=True, slots=True)
class RequestView:
    """One live (waiting or running) request as the engine last reported it."""

    request_id: str
    job_id: str
    is_last_step: bool
    arrival_s: float
    prompt_tokens: int
    state: RequestState
    # Tokens whose KV is already computed (prefix-cache hit or progress so far).
    computed_tokens: int = 0
    # Tool name the client or an orchestrator announced for this turn, if any.
    tool_hint: str | None = None
    # Prompt tokens the engine found in its prefix cache when it first admitted the
    # request (0 until then).
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PinView:
    """KV blocks of a finished request that the engine keeps for its job."""

    request_id: str
    job_id: str
    blocks: int
    pinned_at_s: float
    expires_at_s: float
    tool: str | None = None


@dataclass(frozen=True, slots=True)
class KvView:
    total_blocks: int
    free_blocks: int
    block_size_tokens: int
    # The engine's last step scheduled nothing although requests waited.
    admission_stalled: bool = False
    # Blocks the waiting requests would take from the free pool, a prefix they share
    # with each other or with a running request or pin counted once or not at all
    # (the plugin reads vLLM's block hashes). None: not reported (an older plugin).
    waiting_demand_blocks: int | None = None

    @property
    def used_fraction(self) -> float:
        """Share of the KV cache in use, in [0, 1]."""
        if self.total_blocks <= 0:
            return 0.0
        return 1.0 - self.free_blocks / self.total_blocks


@dataclass(frozen=True, slots=True)
class JobView:
    """What the daemon knows about a job, summarised for policies."""

    job_id: str
    # Arrival of the job's first request seen by this daemon (job-level FCFS key).
    first_arrival_s: float
    turns_finished: int = 0
    # Departure time and tool of the most recent finished turn, if any.
    last_departure_s: float | None = None
    last_tool: str | None = None
    # Requests of the job that arrived and have not finished yet (several when an
    # agent fans out); 0 between turns.
    requests_in_flight: int = 0


@dataclass(frozen=True, slots=True)
class ToolTimeDistribution:
    """Empirical distribution of one tool's durations (seconds), from a log-bucket sketch.

    ``bucket_counts`` maps a bucket index ``i`` to the number of samples whose duration
    ``d`` satisfies ``gamma**(i-1) < d <= gamma**i``. Quantiles are accurate to the
    sketch's relative accuracy ``(gamma - 1) / (gamma + 1)``.
    """

    tool: str
    count: int
    mean_log_s: float
    var_log_s: float
    gamma: float
    bucket_counts: Mapping[int, int] = field(default_factory=dict)
    # Bucket indices in order and their cumulative counts, computed once: policies
    # read several quantiles per decision, each then costs O(log buckets).
    _indices: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _cumulative: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # The survival function S(t) = P(duration > t) as a polyline (each bucket's mass
    # spread evenly over it), and its running integral at each corner: conditional
    # questions ("it has run 3 s; will it be back within 2 s?") then cost O(log).
    _corners_s: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _survival: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _integral_s: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        indices = tuple(sorted(self.bucket_counts))
        cumulative = []
        seen = 0
        for index in indices:
            seen += self.bucket_counts[index]
            cumulative.append(seen)
        object.__setattr__(self, "_indices", indices)
        object.__setattr__(self, "_cumulative", tuple(cumulative))
        corners, survival = [0.0], [1.0]
        total = seen
        below = 0
        for index, count in zip(indices, (self.bucket_counts[i] for i in indices), strict=True):
            lower_s, upper_s = self.gamma ** (index - 1), self.gamma**index
            if total <= 0:
                break
            if lower_s > corners[-1]:
                corners.append(lower_s)
                survival.append(survival[-1])
            below += count
            corners.append(upper_s)
            survival.append(max(1.0 - below / total, 0.0))
        integral = [0.0]
        for k in range(1, len(corners)):
            width = corners[k] - corners[k - 1]
            integral.append(integral[-1] + width * (survival[k] + survival[k - 1]) / 2.0)
        object.__setattr__(self, "_corners_s", tuple(corners))
        object.__setattr__(self, "_survival", tuple(survival))
        object.__setattr__(self, "_integral_s", tuple(integral))

    @property
    def mean_s(self) -> float:
        """Mean duration estimated from the log-normal moments."""
        if self.count == 0:
            return math.nan
        return math.exp(self.mean_log_s + self.var_log_s / 2.0)

    def probability_within(self, tau_s: float) -> float:
        """P(duration <= tau_s), in [0, 1]; NaN with no samples."""
        if self.count == 0:
            return math.nan
        if tau_s <= 0:
            return 0.0
        limit = math.ceil(math.log(tau_s) / math.log(self.gamma) - 1e-12)
        position = bisect.bisect_right(self._indices, limit)
        below = self._cumulative[position - 1] if position else 0
        return min(below / self.count, 1.0)

    def survival(self, t_s: float) -> float:
        """P(duration > t_s) with each bucket's mass spread evenly over the bucket;
        NaN with no samples."""
        if self.count == 0:
            return math.nan
        return self._survival_and_integral(t_s)[0]

    def probability_within_given(self, elapsed_s: float, tau_s: float) -> float:
        """P(duration <= elapsed_s + tau_s | duration > elapsed_s): the chance that a
        tool which has already run ``elapsed_s`` is back within ``tau_s`` more. A tool
        that has run longer than any sample is given 0 (no evidence it ever returns).
        NaN with no samples."""
        outlook = self.conditional_outlook(elapsed_s, (tau_s,))
        return outlook[0][0] if outlook else math.nan

    def expected_remaining_s(self, elapsed_s: float, horizon_s: float) -> float:
        """E[min(duration - elapsed_s, horizon_s) | duration > elapsed_s]: how long a
        pin kept for at most ``horizon_s`` more is expected to be held. ``horizon_s``
        for a tool that has run longer than any sample; NaN with no samples."""
        outlook = self.conditional_outlook(elapsed_s, (horizon_s,))
        return outlook[0][1] if outlook else math.nan

    def conditional_outlook(
        self, elapsed_s: float, horizons_s: Sequence[float]
    ) -> tuple[tuple[float, float], ...]:
        """For each horizon h: (P(back within h | has run elapsed_s), expected seconds
        held within h) — ``probability_within_given`` and ``expected_remaining_s`` for
        several horizons at once (a policy re-values every pin each step). Empty with
        no samples."""
        if self.count == 0:
            return ()
        alive, start = self._survival_and_integral(elapsed_s)
        if alive <= 0.0:
            return tuple((0.0, max(h, 0.0)) for h in horizons_s)
        # _survival_and_integral inlined, and min/max as comparisons (the same values,
        # NaN included): a policy asks this for every pin at every step.
        corners = self._corners_s
        survival = self._survival
        integral = self._integral_s
        last = len(corners)
        outlook: list[tuple[float, float]] = []
        for horizon_s in horizons_s:
            if horizon_s < 0.0:
                horizon_s = 0.0
            t_s = elapsed_s + horizon_s
            if t_s <= 0.0:
                later, end = 1.0, 0.0
            else:
                position = bisect.bisect_right(corners, t_s)
                if position >= last:  # past the last sample: S is 0 from there on
                    later, end = survival[-1], integral[-1]
                else:
                    left = position - 1
                    x0, x1 = corners[left], corners[position]
                    s0 = survival[left]
                    fraction = (t_s - x0) / (x1 - x0) if x1 > x0 else 0.0
                    later = s0 + (survival[position] - s0) * fraction
                    end = integral[left] + (t_s - x0) * (s0 + later) / 2.0
            back = 1.0 - later / alive
            if back < 0.0:
                back = 0.0
            if back > 1.0:
                back = 1.0
            held_s = (end - start) / alive
            if held_s < 0.0:
                held_s = 0.0
            if held_s > horizon_s:
                held_s = horizon_s
            outlook.append((back, held_s))
            if later <= 0.0:  # past every sample: longer horizons change nothing
                outlook.extend([outlook[-1]] * (len(horizons_s) - len(outlook)))
                break
        return tuple(outlook)

    def _survival_and_integral(self, t_s: float) -> tuple[float, float]:
        """S(t_s) and the integral of S over [0, t_s], on the polyline."""
        corners = self._corners_s
        if t_s <= 0.0:
            return 1.0, 0.0
        position = bisect.bisect_right(corners, t_s)
        if position >= len(corners):  # past the last sample: S is 0 from there on
            return self._survival[-1], self._integral_s[-1]
        left = position - 1
        x0, x1 = corners[left], corners[position]
        s0, s1 = self._survival[left], self._survival[position]
        fraction = (t_s - x0) / (x1 - x0) if x1 > x0 else 0.0
        s_t = s0 + (s1 - s0) * fraction
        return s_t, self._integral_s[left] + (t_s - x0) * (s0 + s_t) / 2.0

    def quantile(self, q: float) -> float:
        """Smallest bucket value v with P(duration <= v) >= q; NaN with no samples."""
        if self.count == 0 or not self._indices:
            return math.nan
        q = min(max(q, 0.0), 1.0)
        position = bisect.bisect_left(self._cumulative, q * self.count)
        index = self._indices[min(position, len(self._indices) - 1)]
        # Representative value of the bucket: its geometric midpoint.
        return 2.0 * self.gamma**index / (self.gamma + 1.0)


@dataclass(frozen=True, slots=True)
class EngineCost:
    """What a step of this engine costs, learned from its reports
    (``sidecar.runtime.steptime``): a step takes ``step_s + prefill_s_per_token x
    prompt tokens computed + decode_s_per_seq x requests decoding``."""

    prefill_s_per_token: float
    decode_s_per_seq: float
    step_s: float
    # Steps it was learned from (decayed), and the standard error of the prefill
    # figure relative to it.
    steps: int
    prefill_relative_error: float


class StepScratch:
    """Scratch space for the hooks of one step view, in the spirit of the Kubernetes
    scheduling framework's ``CycleState``: what one hook computes and another hook of
    the same step reads again (a price, an admission order) is kept here, not behind
    the caller's back. Every ``StepView`` starts with an empty one, and so does a view
    derived with ``dataclasses.replace`` (the runtime derives one when pins change
    within a step). Each user keys its entries by itself (a policy: ``self``). An
    entry that holds the view itself makes a reference cycle that only the garbage
    collector frees: hold a copy (``dataclasses.replace(view)``) or the fields."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[object, object] = {}

    def get_or_create(self, key: object, create: Callable[[], _Value]) -> _Value:
        """The entry under ``key``, created by ``create()`` on first use."""
        try:
            return self._entries[key]  # type: ignore[return-value]
        except KeyError:
            value = self._entries[key] = create()
            return value


@dataclass(frozen=True, slots=True)
class StepView:
    """Everything a policy may look at when deciding one engine step, and the step's
    scratch space (``scratch``)."""

    engine_id: str
    now_s: float
    kv: KvView
    waiting: Sequence[RequestView]
    running: Sequence[RequestView]
    pins: Sequence[PinView]
    jobs: Mapping[str, JobView]
    # Measured durations of the tools the pins wait on (by tool name; a tool with no
    # sample is absent), and of all tools pooled: policies that re-value pins while
    # the tool runs read these.
    tool_times: Mapping[str, ToolTimeDistribution] = field(default_factory=dict)
    global_tool_times: ToolTimeDistribution | None = None
    # This engine's step cost learned from its reports; None until known well enough.
    engine_cost: EngineCost | None = None
    # Requests that arrived up to this time are in ``waiting`` or ``running``; one
    # that arrived after it may not be reported yet (None: up to ``now_s``). The
    # report that ends a step is sent before the requests that arrived during the
    # step are added (the next step's report brings them), so the mirror sets the
    # previous report's time: a job seen in a tool until then may be back since.
    arrivals_seen_until_s: float | None = None
    # Prompt tokens this engine computed a second over the last ~10 s of its clock
    # (sidecar.runtime.steptime.PrefillRate); None before its second report. Times
    # the prefill cost: the share of its time the engine spends on prompts.
    prefill_tokens_per_s: float | None = None
    # The share of this engine's recent answers it applied 3 or more steps after their
    # report (sidecar/telemetry/answer_lag.py); None before any. How long what the
    # engine holds for the daemon's answer waits on it.
    late_answer_share: float | None = None
    # Scratch space of this view's hooks (never compared, never copied by replace).
    scratch: StepScratch = field(default_factory=StepScratch, init=False, repr=False,
                                 compare=False)

    @property
    def seen_until_s(self) -> float:
        """The time up to which every arrival is in this view."""
        if self.arrivals_seen_until_s is None:
            return self.now_s
        return min(self.arrivals_seen_until_s, self.now_s)


@dataclass(frozen=True, slots=True)
class FinishInput:
    """A request has finished; the policy decides what happens to its KV blocks."""

    step: StepView
    request: RequestView
    output_tokens: int
    # KV blocks the finished request holds.
    blocks: int
    # Tool the turn ended with (client hint wins over parsing), if any.
    tool: str | None
    # Measured distribution of that tool, and of all tools (cold-start fallback).
    tool_times: ToolTimeDistribution | None
    global_tool_times: ToolTimeDistribution | None


class RetainAction(enum.Enum):
    RELEASE = "release"  # free the blocks at once (vLLM's behaviour)
    PIN = "pin"  # keep the blocks out of the free queue for ttl_s
    SOFT_RETAIN = "soft_retain"  # free them, but at a retention priority


@dataclass(frozen=True, slots=True)
class RetainDecision:
    action: RetainAction
    ttl_s: float = 0.0
    # Eviction priority 0-100 for SOFT_RETAIN (higher is evicted later).
    retention_priority: int | None = None
    # Human-readable rule that produced this decision (shown by Explain).
    reason: str = ""
    # Request ids of *other* pins the runtime releases when it applies this decision,
    # e.g. the job's older pin that this finish supersedes (Continuum: "a job's new
    # finish replaces its old pin"). Never contains the finished request itself;
    # releasing an id that is no longer pinned is harmless (idempotent).
    release_pins: tuple[str, ...] = ()

    @staticmethod
    def release(reason: str, release_pins: tuple[str, ...] = ()) -> RetainDecision:
        return RetainDecision(RetainAction.RELEASE, reason=reason, release_pins=release_pins)

    @staticmethod
    def pin(ttl_s: float, reason: str, release_pins: tuple[str, ...] = ()) -> RetainDecision:
        return RetainDecision(
            RetainAction.PIN, ttl_s=ttl_s, reason=reason, release_pins=release_pins
        )


@dataclass(frozen=True, slots=True)
class Ordering:
    """Request ids in order, with the rule that produced it (shown by Explain)."""

    request_ids: Sequence[str]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PressureOrder:
    """Pins the engine may release, first first, when an allocation for a running
    request fails — valid only while at most ``max_running`` requests run (None: any
    number). The engine applies it between decisions, so the condition travels with it."""

    request_ids: Sequence[str]
    max_running: int | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PinRelease:
    """Pins the policy wants released now."""

    request_ids: Sequence[str]
    reason: str = ""
    # Released pins whose blocks should stay cached at a retention priority (0-100,
    # higher evicted later; vLLM's own blocks sit at 35) instead of vLLM's plain free.
    retention_priorities: Mapping[str, int] = field(default_factory=dict)
