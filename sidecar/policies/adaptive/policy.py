"""``adaptive``: every step, each pin and each admission valued by expected cost and
benefit — the tool's measured time given how long it has run, the current memory
pressure, the recompute cost of the context — with job-level admission and a bound on
how long any request waits.

See README.md beside this file for the rules, the formulas and the parameters.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from sidecar.framework.types import (
    FinishInput,
    Ordering,
    PinRelease,
    PinView,
    PressureOrder,
    RequestView,
    RetainAction,
    RetainDecision,
    StepView,
    ToolTimeDistribution,
)
from sidecar.policies.adaptive.forecast import (
    AdmissionRate,
    ArrivalOrderClock,
    FcfsRecompute,
    PerEngine,
    PriceForecast,
    ReleasedContexts,
)
from sidecar.policies.adaptive.value import (
    Outlook,
    PinValue,
    Pressure,
    Valuation,
    memory_pressure,
    outlook_of,
    pin_value,
    price_with_released,
    recompute_s,
    retention_priority,
)
from sidecar.policies.adaptive.waiting import PinShare, answers_run_late
from sidecar.policies.base import (
    NativePolicy,
    PolicyParams,
    blocks_to_admit,
    expired_unless_job_waits,
    job_level_victims,
    job_level_waiting_key,
    pinned_blocks_by_job,
    superseded_pins,
    tool_distribution,
)

# Seconds to prefill one token until the engine's own figure is learned: Llama-3.1-8B
# on one RTX 5090-class GPU (~9-10k prompt tokens/s).
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4


class AdaptiveParams(PolicyParams):
    # Seconds to prefill one context token: what losing a context costs. Unset: the
    # figure the daemon learns from the engine's steps (StepView.engine_cost), and
    # DEFAULT_PREFILL_S_PER_TOKEN until it is known. Set it to pin a figure.
    prefill_s_per_token: float | None = Field(default=None, ge=0.0)
    # Engine seconds that holding the whole KV cache for one second costs when the
    # waiting requests find no free block at all (scaled down with the shortage).
    memory_price: float = Field(default=1.0, ge=0.0)
    # How far ahead a pin is planned: candidate horizons, the longest is the most a
    # pin is ever kept past its tool's start (the engine also caps it, max_pin_s),
    # and the most of its job's age a waiting turn holding no pin is credited with.
    horizons_s: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
    # Below this many samples of the tool, the distribution of all tools is used.
    min_samples: int = Field(default=5, ge=1)
    # With no sample at all: P(back within cold_start_horizon_s).
    cold_start_probability: float = Field(default=0.5, ge=0.0, le=1.0)
    cold_start_horizon_s: float = Field(default=2.0, ge=0.0)
    # Bound on waiting: a request waiting more than this multiple of its fair share
    # (the wait arrival order would give it, see AdaptivePolicy.fair_shares_s; at least
    # min_fair_share_s) is admitted before any other, oldest first, and pins give way.
    fair_share_multiple: float = Field(default=1.75, gt=0.0)
    min_fair_share_s: float = Field(default=1.0, gt=0.0)
    # How far the bound widens as memory gets short: fair_share_multiple x (1 +
    # overdue_widening x price / memory_price), so 1 is up to twice the multiple and 0
    # never wider. 0 with a small multiple trades the average job for a first-token
    # tail near FCFS's (README, "Tail first").
    overdue_widening: float = Field(default=1.0, ge=0.0)
    # Time constant of the average admission rate the fair share is computed from.
    admission_window_s: float = Field(default=10.0, gt=0.0)
    # The fair share counts what FCFS would re-compute of the contexts this engine
    # keeps (memory short): FCFS admits more slowly than the engine does, and the
    # share is the wait FCFS would give (forecast.py, FcfsRecompute).
    share_counts_fcfs_recompute: bool = True
    # Engine time of one step: ~11 ms for an 8B model on one GPU. Not used by the
    # rules any more (the fair share was a step per job); kept so that deployments
    # and the engine benchmark that set it stay valid.
    step_s: float = Field(default=0.011, gt=0.0)
    # Time constant of the average price of memory a pin is valued at (the larger of
    # it and the current price: a pin pays the price of the seconds it holds memory,
    # see forecast.py); 0 values pins at the current price alone.
    price_window_s: float = Field(default=10.0, ge=0.0)
    # Retention priorities of released (non-last-step) contexts: from lowest (the
    # job is unlikely back soon) to highest; vLLM's own free blocks sit at 35.
    soft_retain_lowest: int = Field(default=36, ge=0, le=100)
    soft_retain_highest: int = Field(default=90, ge=0, le=100)
    # Pins are priced at what they displace too: while the waiting requests fit in
    # the free blocks, the cached contexts this policy released for jobs still in a
    # tool want the rest (value.py, memory_pressure). False: the waiting demand only.
    price_counts_released_contexts: bool = True
    # While the daemon decides on a finished turn's pin, the engine keeps its blocks
    # cached at the top retention priority (True) instead of holding them (False):
    # an answer that lands late then holds nothing, but admissions may take the
    # blocks before the pin lands (vllm_plugin/provisional.py; the adaptive README).
    # "auto": cache while the engine applies a tenth or more of its answers 3 or more
    # steps late; otherwise hold while at least half of the recent finishes were
    # pinned, else cache (waiting.py).
    provisional_cache: bool | Literal["auto"] = "auto"
    # The engine is saturated by prefill while computing prompts takes at least this
    # share of its time (the last ~10 s, StepView.prefill_tokens_per_s x the prefill
    # cost). Then a job's age is credited to every waiting request; below it only to
    # those that fit in the free blocks, a request that does not fit keeping its
    # place in arrival order (README, "Unless the engine has time to spare"). 0: every
    # request credited (item 24's rule); above 1: only those that fit.
    saturated_prefill_share: float = Field(default=0.4, ge=0.0)
    # The most of its job's age a waiting request of a job holding no pin is credited
    # with (README, "Job order for every job"). Unset: the longest pin horizon
    # (horizons_s[-1], 30 s by default). 0: those requests keep arrival order, behind
    # the requests of jobs holding a pin.
    job_age_credit_s: float | None = Field(default=None, ge=0.0)
    # Which waiting requests of jobs holding no pin are credited while the engine is
    # below saturated_prefill_share: "fitting", those that fit in the free blocks
    # (item 26); "none", none of them, arrival order past the jobs holding a pin (an
    # engine with time to spare gains little from reordering; ADAPTIVE.md, item 31).
    credit_below_saturation: Literal["fitting", "none"] = "fitting"

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


class _StepMemo:
    """What several hooks of one step compute alike: the decider calls them in turn
    with the same frozen step, so each is computed once per step (a re-valued pin
    set after releases is a new step object, and a new memo)."""

    __slots__ = ("order", "outlooks", "p_returns", "pin_price", "pressure", "released_price",
                 "step", "valuation", "values", "victims")

    def __init__(self, step: StepView) -> None:
        self.step = step
        self.pressure: Pressure | None = None
        # The forecast price of memory over the seconds ahead (waiting demand only).
        self.pin_price: float | None = None
        # The same counting the released contexts a pin displaces: what pins are
        # valued at.
        self.released_price: float | None = None
        # (waiting requests in admission order, how many are overdue, whether the
        # engine keeps up and the order is arrival order)
        self.order: tuple[list[RequestView], int, bool] | None = None
        self.values: dict[tuple[str, float], PinValue] = {}
        # Per pin: its tool's conditional outlook and where the distribution came from.
        self.outlooks: dict[str, tuple[Outlook, str]] = {}
        # Per pin: P(its job is back within the longest horizon), where no outlook is
        # known (the idle-memory release and the pressure order both ask).
        self.p_returns: dict[str, float] = {}
        self.valuation: Valuation | None = None
        # The preemption order: the decider asks for it, and the pressure order
        # prices pins against its first victim.
        self.victims: Ordering | None = None


class AdaptivePolicy(NativePolicy):
    name = "adaptive"
    pins_finished_requests = True
    reads_waiting_demand = True  # the price of memory (value.memory_pressure)
    params_model: ClassVar[type[PolicyParams]] = AdaptiveParams
    params: AdaptiveParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        p = self.params
        self._pin_shares: dict[str, PinShare] = {}  # provisional_cache=auto, per engine
        self._local = threading.local()
        self._forecast = PriceForecast(p.price_window_s)
        self._admissions = AdmissionRate(p.admission_window_s)
        self._arrival_order = ArrivalOrderClock()
        self._fcfs_recompute = FcfsRecompute(p.admission_window_s)
        self._released = ReleasedContexts(p.horizons_s[-1])
        self._released_forecast = PriceForecast(p.price_window_s)

    def _memo(self, step: StepView) -> _StepMemo:
        memo: _StepMemo | None = getattr(self._local, "memo", None)
        if memo is None or memo.step is not step:
            memo = _StepMemo(step)
            self._local.memo = memo
        return memo

    def prefill_s_per_token(self, step: StepView) -> float:
        """What computing one context token costs on this engine: the parameter if
        set, else the figure learned from the engine's steps, else the default."""
        if self.params.prefill_s_per_token is not None:
            return self.params.prefill_s_per_token
        if step.engine_cost is not None:
            return step.engine_cost.prefill_s_per_token
        return DEFAULT_PREFILL_S_PER_TOKEN

    def _valuation(self, step: StepView) -> Valuation:
        memo = self._memo(step)
        if memo.valuation is None:
            p = self.params
            memo.valuation = Valuation(self.prefill_s_per_token(step), p.horizons_s,
                                       p.cold_start_probability, p.cold_start_horizon_s)
        return memo.valuation

    def _pressure(self, step: StepView) -> Pressure:
        memo = self._memo(step)
        if memo.pressure is None:
            memo.pressure = memory_pressure(step, self.params.memory_price)
        return memo.pressure

    def _pin_price(self, step: StepView) -> float:
        """The forecast price of memory from the waiting demand: the current price, or
        the recent average when memory was short lately. It measures the shortage the
        fair share weighs FCFS's re-compute by."""
        memo = self._memo(step)
        if memo.pin_price is None:
            memo.pin_price = self._forecast.update(step.engine_id, step.now_s,
                                                   self._pressure(step).price)
        return memo.pin_price

    def _price_for_pins(self, step: StepView) -> float:
        """The price a pin is valued at: as ``_pin_price``, counting also the released
        contexts it displaces (``price_counts_released_contexts``; the seconds a pin
        holds are priced by the forecast)."""
        waiting_price = self._pin_price(step)  # every step, so its forecast sees them all
        if not self.params.price_counts_released_contexts:
            return waiting_price
        memo = self._memo(step)
        if memo.released_price is None:
            released = self._released.blocks(
                step.engine_id, step.now_s,
                back_jobs=[r.job_id for r in (*step.waiting, *step.running)],
                pinned_jobs=[pin.job_id for pin in step.pins])
            price = price_with_released(self._pressure(step), self.params.memory_price,
                                        released)
            memo.released_price = self._released_forecast.update(step.engine_id,
                                                                 step.now_s, price)
        return memo.released_price

    def _remember_released(self, step: StepView, job_id: str, blocks: int) -> None:
        # Only while they are counted: the record is pruned when it is read.
        if self.params.price_counts_released_contexts:
            self._released.record(step.engine_id, job_id, blocks, step.now_s)

    # --- admission: overdue requests first, then job-level order --------------------

    def order_waiting(self, step: StepView) -> Ordering:
        ordered, overdue, keeping_up = self._admission_order(step)
        if keeping_up:
            return Ordering(tuple(r.request_id for r in ordered),
                            "adaptive: engine keeping up (memory idle, no wait past "
                            f"{self.params.min_fair_share_s:g} s): arrival order")
        share = self.prefill_share(step)
        credited = {"all": "every one", "fitting": "those that fit in the free blocks",
                    "none": "none below saturation"}[self._credit_scope(share)]
        reason = ("adaptive: jobs holding a pin first, oldest job first; then the others, "
                  f"by job age up to {self.job_age_credit_s:g} s ({credited}: the "
                  f"engine prefills {share:.0%} of its time)")
        if overdue:
            reason = (f"adaptive: {overdue} request(s) past {self.overdue_multiple(step):.3g}x "
                      f"fair share first, oldest first; then {reason[10:]}")
        return Ordering(tuple(r.request_id for r in ordered), reason)

    @property
    def job_age_credit_s(self) -> float:
        """The most of its job's age a waiting request holding no pin ranks by: the
        parameter, or the longest pin horizon (a job's next turn goes before the
        first turns of jobs that came up to that long after it)."""
        credit_s = self.params.job_age_credit_s
        return self.params.horizons_s[-1] if credit_s is None else credit_s

    def prefill_share(self, step: StepView) -> float:
        """The share of its time the engine spent computing prompts lately (0 before
        it is known): the rate its reports carry times what a token costs."""
        per_s = step.prefill_tokens_per_s
        return 0.0 if per_s is None else per_s * self.prefill_s_per_token(step)

    def _credit_scope(self, share: float) -> Literal["all", "fitting", "none"]:
        """Which waiting requests of jobs holding no pin are credited their job's age:
        every one on an engine saturated by prefill, else as credit_below_saturation
        says."""
        if share >= self.params.saturated_prefill_share:
            return "all"
        return self.params.credit_below_saturation

    def fair_share_s(self, step: StepView, fcfs_factor: float = 1.0) -> float:
        """A request's fair share of waiting: the wait arrival order would give it
        now, by Little's law the requests waiting over the rate FCFS would admit them
        (``L / λ``, λ the engine's rate times ``fcfs_factor``; at least
        ``min_fair_share_s``, and that least while the rate is not known yet).

        FCFS holds every request about that long; the bound lets job-level order
        make a request wait a few times longer, no more. The rate is the one this
        engine achieves, so while a backlog builds the share grows with it, and the
        jobs in flight go on finishing first instead of being evicted by new ones
        forced in at the arrival rate. Measured against the rule it replaced (the
        larger of a step per job in the system and the mean wait of the waiting
        requests; twin, seed 0): the mean wait of a queue in arrival order is half
        its oldest request's, so 2x it never fired however long new jobs waited
        (calibrated, 12 jobs/s, 9,000 blocks: 15.1 s maximum TTFT against FCFS's 3.2
        s). With L / λ: 7.6 s there; jobs sharing nothing, 8 jobs/s, 9,000 blocks:
        117 s against 276 s (FCFS 192 s), at 211 s a job against 178 s (continuum
        224 s)."""
        # Called every step (fair_shares_s): it records the step's running requests,
        # from which the rate counts admissions.
        rate_per_s = self._admissions.update(
            step.engine_id, step.now_s, frozenset(r.request_id for r in step.running))
        fcfs_rate_per_s = rate_per_s * fcfs_factor
        little_s = len(step.waiting) / fcfs_rate_per_s if fcfs_rate_per_s > 0.0 else 0.0
        return max(little_s, self.params.min_fair_share_s)

    def fair_shares_s(self, step: StepView) -> dict[str, float]:
        """Each waiting request's fair share of waiting: the lesser of the wait
        arrival order gives a request arriving now (``fair_share_s``, ``L / λ``) and,
        once arrival order would have admitted this one, the wait it would have given
        it (``ArrivalOrderClock``); at least ``min_fair_share_s``.

        ``L / λ`` alone runs away while a backlog builds: the queue grows and the
        rate falls, so the bound on an old request grew faster than the request aged
        and never fired (twin, 11-turn jobs, 8 jobs/s, 5,402 blocks: the bound rose
        from 36 to 97 s while the oldest request aged from 19 to 47 s; maximum TTFT
        75 s against FCFS's 52 s). The wait arrival order would have given the
        request is fixed once due. Either one alone was measured (README).

        Both count the engine's admissions at what they are worth to FCFS, which
        re-computes what the engine kept when memory is short and admits fewer
        (``_fcfs_weigh``; jobs sharing nothing, 3,000 blocks, 4 jobs/s: 98.6 s a job
        counted one for one, 80.0 s so, continuum 82.8 s)."""
        # Every step passes here (order_waiting is asked every step): both forecasts
        # are fed the step's requests.
        weigh = self._fcfs_weigh(step) if self.params.share_counts_fcfs_recompute else None
        due_at_s = self._arrival_order.update(step.engine_id, step.now_s,
                                              step.waiting, step.running, weigh)
        # FCFS admits at the engine's rate times the factor: L / λ grows by it.
        now_share_s = self.fair_share_s(
            step, self._fcfs_recompute.factor(step.engine_id) if weigh else 1.0)
        least_s = self.params.min_fair_share_s
        shares = {}
        for request in step.waiting:
            share_s = now_share_s
            due_s = due_at_s.get(request.request_id)
            if due_s is not None:
                share_s = min(share_s, max(due_s - request.arrival_s, least_s))
            shares[request.request_id] = share_s
        return shares

    def _fcfs_weigh(self, step: StepView) -> Callable[[list[RequestView]], float]:
        """What each admission of this step is worth in FCFS's admissions: fewer the
        more of the contexts this engine kept FCFS would have re-computed, memory
        short (``FcfsRecompute``)."""
        shortage = (self._pin_price(step) / self.params.memory_price
                    if self.params.memory_price > 0.0 else 0.0)
        prefill_s_per_token = self.prefill_s_per_token(step)

        def first_turn(request: RequestView) -> bool:
            job = step.jobs.get(request.job_id)
            return job is None or job.turns_finished == 0

        def weigh(admitted: list[RequestView]) -> float:
            return self._fcfs_recompute.update(step.engine_id, step.now_s, admitted,
                                               first_turn, prefill_s_per_token, shortage)
        return weigh

    def overdue_multiple(self, step: StepView) -> float:
        """How many fair shares a request waits before it goes first:
        ``fair_share_multiple`` while memory is idle, up to ``1 + overdue_widening``
        times that (twice, by default) as memory gets short (scaled by the shortage,
        ``price / memory_price``).

        Admitting an overdue request costs the working sets its blocks displace. With
        memory idle it displaces none, and a tight bound holds the tail at saturation
        (calibrated twin, 12 jobs/s: maximum TTFT within 1.05x FCFS's at 3,000 and
        5,402 blocks). With memory short the same bound forced new jobs in over the
        contexts of jobs in flight, and the engine re-computed them (jobs sharing
        nothing, 4 jobs/s, 3,000 blocks: 94.5 s per job at 2x, 72.9 s at 4x)."""
        multiple = self.params.fair_share_multiple
        if self.params.memory_price <= 0.0 or self.params.overdue_widening == 0.0:
            return multiple
        shortage = self._pressure(step).price / self.params.memory_price
        return multiple * (1.0 + self.params.overdue_widening * shortage)

    def _admission_order(self, step: StepView) -> tuple[list[RequestView], int, bool]:
        memo = self._memo(step)
        if memo.order is None:
            memo.order = self._compute_admission_order(step)
        return memo.order

    def _compute_admission_order(self, step: StepView
                                 ) -> tuple[list[RequestView], int, bool]:
        """(waiting requests in admission order, how many are overdue, whether the
        engine keeps up).

        Past the overdue requests, the jobs holding a pin go first, oldest job first
        (Continuum's order): the turn uses the pin and frees it, and no new job takes
        its blocks. Every other request goes by its job's age too, credited for at
        most ``job_age_credit_s`` (unless set, the longest pin horizon, 30 s): it
        ranks as if it had arrived that much earlier, or when its job did if that is
        later. A job's next turn then goes before the first turns of jobs that came
        up to that long after it, which is what finishes jobs sooner on a saturated
        engine, its released context mostly still cached; a new job's first turn is
        not held behind every older job's under heavy overload. ADAPTIVE.md, item 24:
        twin run like the CPU engine with a model 9x slower to prefill (``twin cpu
        --like``, 6 seeds), 0.845 of FCFS's job, as continuum, against 0.962 in
        arrival order; 11 turns, 3,000 blocks, 12 jobs/s, maximum TTFT 1.05x FCFS's,
        1.31x with the whole age counted.

        Unless the engine is saturated by prefill (``saturated_prefill_share``), a
        request that does not fit in the free blocks is not credited: it keeps its
        place in arrival order. vLLM's queue stops at the first request that does not
        fit, and an engine with time to spare would leave the requests that fit
        behind it waiting for nothing; a saturated one would only share its time
        with them. ADAPTIVE.md, item 26: twin run like the tenth VM, whose engine
        prefilled under a third of its time, 1.026 -> 0.979 of FCFS's job; like the
        9x model's engine (over half) 0.843, unchanged."""
        multiple = self.overdue_multiple(step)
        shares_s = self.fair_shares_s(step)
        overdue = {r.request_id for r in step.waiting
                   if step.now_s - r.arrival_s > multiple * shares_s[r.request_id]}
        if self._keeping_up(step):
            # Nothing to protect: arrival order, as FCFS (oldest first, overdue or not).
            ordered = sorted(step.waiting, key=lambda r: (r.arrival_s, r.request_id))
            return ordered, len(overdue), True
        job_level = job_level_waiting_key(step)

        credit_s = self.job_age_credit_s
        scope = self._credit_scope(self.prefill_share(step))
        free_blocks = step.kv.free_blocks
        block_tokens = step.kv.block_size_tokens

        def key(request: RequestView) -> tuple[float, ...]:
            # Overdue requests first, oldest first; then the jobs holding a pin, oldest
            # job first; then the others by their job's age, credited at most credit_s
            # (unless saturated, only those that fit).
            if request.request_id in overdue:
                return (0, request.arrival_s)
            job_pinless, first_s, arrival_s, _ = job_level(request)
            if job_pinless:
                if scope == "all" or (scope == "fitting" and blocks_to_admit(
                        request, block_tokens, 0) <= free_blocks):
                    return (2, max(first_s, arrival_s - credit_s), arrival_s)
                return (2, arrival_s, arrival_s)
            return (1, first_s, arrival_s)

        # Ties (equal keys) are broken by request id: the order is total.
        ordered = sorted(sorted(step.waiting, key=lambda r: r.request_id), key=key)
        return ordered, len(overdue), False

    def _keeping_up(self, step: StepView) -> bool:
        """The engine keeps up: memory is idle (the waiting requests fit in the free
        blocks) and no request has waited a full minimum fair share. Job-level order
        then protects no working set and only delays new jobs behind the turns of
        older ones for a few steps (measured in the twin: 8 jobs/s, calibrated
        workload, maximum TTFT 0.5-0.6 s against FCFS's 0.4 s, the same average).
        Once a backlog builds or memory is short, job-level order keeps jobs in
        flight finishing and new jobs from evicting them."""
        if self._pressure(step).price > 0.0:
            return False
        oldest_wait_s = max((step.now_s - r.arrival_s for r in step.waiting), default=0.0)
        return oldest_wait_s <= self.params.min_fair_share_s

    # --- preemption: the newest non-last-step job first (its context is smallest) ----

    def order_victims(self, step: StepView) -> Ordering:
        memo = self._memo(step)
        if memo.victims is None:
            memo.victims = Ordering(
                tuple(r.request_id for r in job_level_victims(step)),
                "adaptive: newest non-last-step job preempted first, then newest job")
        return memo.victims

    # --- finish: pin, soft-retain or release by value -------------------------------

    def forget_engine(self, engine_id: str) -> None:
        self._pin_shares.pop(engine_id, None)
        for per_engine in self._per_engine():
            per_engine.forget(engine_id)

    def engines_known(self) -> frozenset[str]:
        """The engines this policy keeps state about (what ``forget_engine`` drops)."""
        known = set(self._pin_shares)
        for per_engine in self._per_engine():
            known |= per_engine.engine_ids
        return frozenset(known)

    def _per_engine(self) -> tuple[PerEngine[Any], ...]:
        return (self._forecast, self._admissions, self._arrival_order, self._fcfs_recompute,
                self._released, self._released_forecast)

    def caches_provisional_pins(self, engine_id: str,
                                late_answer_share: float | None = None) -> bool:
        mode = self.params.provisional_cache
        if mode != "auto":
            return mode
        if answers_run_late(late_answer_share):
            return True
        share = self._pin_shares.get(engine_id)
        return share is not None and share.caches()

    def on_finish(self, finished: FinishInput) -> RetainDecision:
        superseded = superseded_pins(finished)
        request = finished.request
        if request.is_last_step:
            return RetainDecision.release(f"{self.name}: last step of the job",
                                          release_pins=superseded)
        step = finished.step
        price = self._price_for_pins(step)
        distribution, source = tool_distribution(
            finished.tool, finished.tool_times, finished.global_tool_times,
            self.params.min_samples)
        valuation = self._valuation(step)
        value = pin_value(
            valuation,
            outlook_of(valuation, distribution, 0.0),
            context_tokens=request.prompt_tokens + finished.output_tokens,
            blocks=finished.blocks,
            total_blocks=step.kv.total_blocks,
            price=price,
            source=source,
        )
        pinned = value.value_s > 0.0 and value.horizon_s > 0.0
        if self.params.provisional_cache == "auto":
            self._pin_shares.setdefault(step.engine_id, PinShare()).record(pinned)
        if pinned:
            return RetainDecision.pin(
                value.horizon_s,
                f"{self.name}: pin {value.horizon_s:g} s worth {value.value_s:.3g} s at "
                f"memory price {price:.2f} ({value.source})",
                release_pins=superseded)
        priority = self._soft_priority(value.p_return)
        self._remember_released(step, request.job_id, finished.blocks)
        return RetainDecision(
            RetainAction.SOFT_RETAIN,
            retention_priority=priority,
            reason=f"{self.name}: no pin repays its memory at price {price:.2f} "
                   f"(P(back within {self.params.horizons_s[-1]:g} s)={value.p_return:.2f}, "
                   f"{value.source}): cached at priority {priority}",
            release_pins=superseded)

    # --- every step: re-value each pin -------------------------------------------------

    def release_under_pressure(self, step: StepView) -> PinRelease:
        """Release every pin no longer worth its memory (its tool has run long, or
        memory got short; a pin whose job's next request already waits is about to be
        used and is not re-valued). Then, when the first request to admit is overdue
        or the engine idles, and it cannot fit, release the least valuable pins (never
        its own job's) until it fits."""
        price = self._price_for_pins(step)  # every step, so the forecasts see idle ones
        if not step.pins:
            return PinRelease((), "")
        waiting_jobs = {r.job_id for r in step.waiting}
        pin_by_id = {pin.request_id: pin for pin in step.pins}
        if price > 0.0:
            released = [pin.request_id for pin in step.pins if pin.job_id not in waiting_jobs
                        and self._value(step, pin, price).value_s <= 0.0]
        else:  # memory idle: a pin costs nothing unless its job is not coming back
            released = [pin.request_id for pin in step.pins if pin.job_id not in waiting_jobs
                        and self._p_return(step, pin) <= 0.0]
        reason = f"adaptive: not worth its memory at price {price:.2f}"

        head = self._forced_head(step)
        if head is not None:
            head_job, shortfall = head
            freed = sum(p.blocks for p in step.pins if p.request_id in set(released))
            # Pins of jobs in a tool, least valuable per block first (a pin whose job's
            # next turn waits is about to be used). An idle engine also takes the pins
            # of other waiting jobs, last: when every pin's job waits and none fits,
            # they would wait on each other until the engine's backstop (max_pin_s,
            # 60 s) freed them (seen on the CPU engine with 24 blocks: 82 s a job).
            idle = not step.running and step.kv.admission_stalled
            candidates = sorted(
                (p for p in step.pins if p.request_id not in released
                 and p.job_id != head_job and (idle or p.job_id not in waiting_jobs)),
                key=lambda p: (p.job_id in waiting_jobs,
                               self._value(step, p, price).value_s / max(p.blocks, 1),
                               p.request_id))
            for pin in candidates:
                if freed >= shortfall:
                    break
                released.append(pin.request_id)
                freed += pin.blocks
            reason += (f"; the first request to admit is overdue or the engine idles, "
                       f"{shortfall} blocks short: least valuable pins give way")
        if not released:
            return PinRelease((), "")
        priorities = {rid: self._soft_priority(self._p_return(step, pin_by_id[rid]))
                      for rid in released}
        for rid in released:
            pin = pin_by_id[rid]
            self._remember_released(step, pin.job_id, pin.blocks)
        return PinRelease(tuple(released), reason, priorities)

    def _forced_head(self, step: StepView) -> tuple[str, int] | None:
        """(job, blocks short) of the first request to admit when it cannot fit and
        must get in now: it is past its fair share, or nothing runs and the engine
        could admit nothing (it would idle until a pin expires). vLLM admits in order
        and stops at the first request that does not fit.

        Otherwise pins do not give way to a request that does not fit: its blocks come
        from the running requests as they finish. Releasing the younger jobs' pins
        for it was measured too: with jobs sharing nothing it turned overload into
        thrashing (4 jobs/s, 5,402 blocks: 105 s per job against 74 s, hit rate 55%
        against 64%)."""
        if not step.waiting:
            return None
        ordered, overdue, _ = self._admission_order(step)
        idle = not step.running and step.kv.admission_stalled
        if not overdue and not idle:
            return None
        head = ordered[0]
        pinned = pinned_blocks_by_job(step.pins)
        need = blocks_to_admit(head, step.kv.block_size_tokens, pinned.get(head.job_id, 0))
        shortfall = need - step.kv.free_blocks
        if idle:
            shortfall = max(shortfall, 1)
        if shortfall <= 0:
            return None
        return head.job_id, shortfall

    def order_pins_under_pressure(self, step: StepView) -> PressureOrder:
        """When a running request's next block cannot be allocated, pins worth less
        than re-computing the first preemption victim give way first (least valuable
        first); the rest are kept and vLLM preempts.

        A pin whose job's next request already waits is about to be used: its loss
        costs its whole re-compute (P(back) = 1, whatever its tool's distribution
        says), so it gives way only if that is less than the victim's, and after
        every pin of a job still in its tool. Valued by its tool alone, it headed
        about one list in ten on the CPU engine (24 blocks, trace of one run)."""
        if not step.pins:
            return PressureOrder((), None, "")
        victims = self.order_victims(step).request_ids
        running = {r.request_id: r for r in step.running}
        victim_cost_s = (recompute_s(running[victims[0]], self.prefill_s_per_token(step))
                         if victims else math.inf)
        price = self.params.memory_price
        waiting_jobs = {r.job_id for r in step.waiting}

        def p_back(pin: PinView) -> float:
            return 1.0 if pin.job_id in waiting_jobs else self._p_return(step, pin)

        cheap = sorted(
            (pin for pin in step.pins
             if p_back(pin) * self._recompute_s(step, pin) < victim_cost_s),
            key=lambda pin: (pin.job_id in waiting_jobs,
                             self._value(step, pin, price).value_s / max(pin.blocks, 1),
                             pin.request_id))
        return PressureOrder(tuple(pin.request_id for pin in cheap), None,
                             "adaptive: pins worth less than re-computing the next victim "
                             "give way first")

    def expire(self, step: StepView) -> PinRelease:
        """Pins whose planned horizon was over by the time this step's arrivals are
        seen until, and whose job has no request waiting. Expired at ``now_s``, a pin
        whose horizon ran out during the step just reported went while its job may
        have been back, not shown yet: the job lost its context, or at best its place
        among the jobs holding a pin (``_tool_elapsed_s``)."""
        expired = expired_unless_job_waits(step, step.seen_until_s)
        return PinRelease(expired,
                          "adaptive: planned horizon over and no request of the job waiting"
                          if expired else "")

    # --- pieces -----------------------------------------------------------------------

    def _recompute_s(self, step: StepView, pin: PinView) -> float:
        return pin.blocks * step.kv.block_size_tokens * self.prefill_s_per_token(step)

    def _value(self, step: StepView, pin: PinView, price: float) -> PinValue:
        values = self._memo(step).values
        key = (pin.request_id, price)
        value = values.get(key)
        if value is None:
            value = values[key] = self._compute_value(step, pin, price)
        return value

    def _distribution(self, step: StepView, pin: PinView
                      ) -> tuple[ToolTimeDistribution | None, str]:
        own = step.tool_times.get(pin.tool) if pin.tool else None
        return tool_distribution(pin.tool, own, step.global_tool_times, self.params.min_samples)

    def _p_return(self, step: StepView, pin: PinView) -> float:
        """P(the pin's job is back within the longest horizon | its tool's elapsed
        time): two look-ups, where a full valuation takes one per horizon."""
        memo = self._memo(step)
        known = memo.outlooks.get(pin.request_id)
        if known is not None:
            return known[0][-1][0]
        p_return = memo.p_returns.get(pin.request_id)
        if p_return is None:
            p_return = memo.p_returns[pin.request_id] = self._compute_p_return(step, pin)
        return p_return

    def _compute_p_return(self, step: StepView, pin: PinView) -> float:
        distribution, _ = self._distribution(step, pin)
        elapsed_s = _tool_elapsed_s(step, pin)
        if distribution is None or distribution.count == 0:
            outlook = outlook_of(self._valuation(step), None, elapsed_s)
            return outlook[-1][0] if outlook else 0.0
        return distribution.probability_within_given(elapsed_s, self.params.horizons_s[-1])

    def _compute_value(self, step: StepView, pin: PinView, price: float) -> PinValue:
        outlooks = self._memo(step).outlooks
        known = outlooks.get(pin.request_id)
        if known is None:
            distribution, source = self._distribution(step, pin)
            elapsed_s = _tool_elapsed_s(step, pin)
            known = outlooks[pin.request_id] = (
                outlook_of(self._valuation(step), distribution, elapsed_s), source)
        outlook, source = known
        return pin_value(
            self._valuation(step),
            outlook,
            context_tokens=pin.blocks * step.kv.block_size_tokens,
            blocks=pin.blocks,
            total_blocks=step.kv.total_blocks,
            price=price,
            source=source,
        )

    def _soft_priority(self, p_return: float) -> int:
        return retention_priority(p_return, self.params.soft_retain_lowest,
                                  self.params.soft_retain_highest)


def _tool_elapsed_s(step: StepView, pin: PinView) -> float:
    """How long the pin's tool is known to have run without its job coming back: up
    to the time the step's arrivals are seen until, not ``now_s``. A job back during
    the step just reported is not in it yet; valued at ``now_s``, its tool had run
    past every sample and the pin was released as never coming back, a step before
    the job's next turn showed (twin, jobs sharing nothing, 8 jobs/s, 3,000 blocks:
    2,278 of 5,803 pins, nearly every tool's, each released within a step or two of
    its tool's longest time; the turn then found its context cached at best)."""
    return max(step.seen_until_s - pin.pinned_at_s, 0.0)
