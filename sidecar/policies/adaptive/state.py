"""``adaptive``'s two kinds of state, named as the policy contract names them.

- :class:`EngineMemory`: what outlives a step, per engine (the forecasts of
  ``forecast.py`` and the pin share of ``waiting.py``), fed by each engine's steps in
  order and dropped by ``forget_engine``.
- :class:`StepState`: what the hooks of one step compute alike (the price of memory,
  the admission order, each pin's value), kept in the step's scratch
  (``StepView.scratch``) and gone with the step.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from sidecar.framework.types import Ordering, RequestView, StepView, ToolTimeDistribution
from sidecar.policies.adaptive.forecast import (
    AdmissionRate,
    ArrivalOrderClock,
    FcfsRecompute,
    PerEngine,
    PriceForecast,
    ReleasedContexts,
)
from sidecar.policies.adaptive.params import DEFAULT_PREFILL_S_PER_TOKEN, AdaptiveParams
from sidecar.policies.adaptive.value import (
    Outlook,
    Pressure,
    Valuation,
    memory_pressure,
    price_with_released,
)
from sidecar.policies.adaptive.waiting import PinShare

_job_id = operator.attrgetter("job_id")
# A view's fields in the order its constructor takes them (every field a copy needs;
# twice as quick as dataclasses.replace).
_view_fields = operator.attrgetter(*(f.name for f in fields(StepView) if f.init))

if TYPE_CHECKING:
    from sidecar.policies.adaptive.admission import AdmissionOrder


class EngineMemory:
    """Per engine, across steps: a few floats for each price forecast and the
    admission rate, the live request ids for the arrival-order clock, the released
    contexts of jobs in a tool, and the recent finishes' pin share. A daemon restart
    starts it afresh (memory assumed idle, the rate unknown) until steps say
    otherwise."""

    def __init__(self, params: AdaptiveParams) -> None:
        # The price from the waiting demand, and the one pins are valued at (counting
        # the released contexts a pin displaces too).
        self.waiting_price = PriceForecast(params.price_window_s)
        self.pin_price = PriceForecast(params.price_window_s)
        self.admissions = AdmissionRate(params.admission_window_s)
        self.arrival_order = ArrivalOrderClock()
        self.fcfs_recompute = FcfsRecompute(params.admission_window_s)
        self.released = ReleasedContexts(params.longest_horizon_s)
        self.pin_shares: dict[str, PinShare] = {}

    def _per_engine(self) -> tuple[PerEngine[Any], ...]:
        return (self.waiting_price, self.pin_price, self.admissions, self.arrival_order,
                self.fcfs_recompute, self.released)

    def forget(self, engine_id: str) -> None:
        self.pin_shares.pop(engine_id, None)
        for per_engine in self._per_engine():
            per_engine.forget(engine_id)

    @property
    def engine_ids(self) -> frozenset[str]:
        known = set(self.pin_shares)
        for per_engine in self._per_engine():
            known |= per_engine.engine_ids
        return frozenset(known)


class StepState:
    """One step's shared figures, each computed on first use. The forecasts are fed
    when a figure is first computed for a step view; a view the runtime derives after
    pins changed feeds them again at the same ``now_s``, which adds no time to their
    averages."""

    __slots__ = ("_pin_price", "_pressure", "_waiting_jobs", "_waiting_price", "admission",
                 "distributions", "memory", "outlooks", "p_returns", "params",
                 "prefill_s_per_token", "seen_until_s", "step", "valuation", "values",
                 "victims")

    def __init__(self, params: AdaptiveParams, memory: EngineMemory, step: StepView) -> None:
        self.params = params
        self.memory = memory
        # A copy of the view with a scratch of its own: this state lives in the view's
        # scratch, and holding the view itself would make a reference cycle that only
        # the garbage collector frees (several views a report, each with this state's
        # figures: most of what the daemon's collector then had to do).
        self.step = StepView(*_view_fields(step))
        self.seen_until_s = step.seen_until_s
        # What computing one context token costs on this engine: the parameter if set,
        # else the figure learned from the engine's steps, else the default.
        if params.prefill_s_per_token is not None:
            self.prefill_s_per_token = params.prefill_s_per_token
        elif step.engine_cost is not None:
            self.prefill_s_per_token = step.engine_cost.prefill_s_per_token
        else:
            self.prefill_s_per_token = DEFAULT_PREFILL_S_PER_TOKEN
        self._pressure: Pressure | None = None
        self._waiting_price: float | None = None
        self._pin_price: float | None = None
        self._waiting_jobs: frozenset[str] | None = None
        self.admission: AdmissionOrder | None = None
        self.victims: Ordering | None = None
        # Per price, per pin: what its best plan is worth.
        self.values: dict[float, dict[str, float]] = {}
        # Per pin: P(its job is back within the longest horizon).
        self.p_returns: dict[str, float] = {}
        # Per pin whose tool has samples: its tool's conditional outlook.
        self.outlooks: dict[str, Outlook] = {}
        # Per tool (None: none announced): the distribution its pins are valued by and
        # where it came from.
        self.distributions: dict[str | None, tuple[ToolTimeDistribution | None, str]] = {}
        # What valuing any pin of this step reads.
        self.valuation = Valuation(self.prefill_s_per_token, params.horizons_s,
                                   params.cold_start_probability, params.cold_start_horizon_s)

    @property
    def pressure(self) -> Pressure:
        """The current price of memory, from the waiting demand against the free
        blocks."""
        if self._pressure is None:
            self._pressure = memory_pressure(self.step, self.params.memory_price)
        return self._pressure

    def waiting_price(self) -> float:
        """The forecast price of memory from the waiting demand: the current price, or
        the recent average when memory was short lately. The fair share weighs FCFS's
        re-compute by it."""
        if self._waiting_price is None:
            step = self.step
            self._waiting_price = self.memory.waiting_price.update(
                step.engine_id, step.now_s, self.pressure.price)
        return self._waiting_price

    def pin_price(self) -> float:
        """The price a pin is valued at: as ``waiting_price``, counting also the
        released contexts of jobs in a tool that a pin displaces while the waiting
        requests fit (value.py, ``memory_pressure``)."""
        self.waiting_price()  # every step, so its forecast sees them all
        if self._pin_price is None:
            step = self.step
            # Lazy: read only while contexts are released (rarely with memory idle).
            released = self.memory.released.blocks(
                step.engine_id, step.now_s,
                back_jobs=map(_job_id, itertools.chain(step.waiting, step.running)),
                pinned_jobs=map(_job_id, step.pins))
            price = price_with_released(self.pressure, self.params.memory_price, released)
            self._pin_price = self.memory.pin_price.update(step.engine_id, step.now_s, price)
        return self._pin_price

    @property
    def waiting_jobs(self) -> frozenset[str]:
        """The jobs with a request waiting (their pins are about to be used)."""
        if self._waiting_jobs is None:
            self._waiting_jobs = frozenset(map(_job_id, self.step.waiting))
        return self._waiting_jobs

    def remember_released(self, job_id: str, blocks: int) -> None:
        """The job's context of ``blocks`` blocks was let go of while its job is in a
        tool: a pin displaces it from now on."""
        self.memory.released.record(self.step.engine_id, job_id, blocks, self.step.now_s)

    def first_turn(self, request: RequestView) -> bool:
        job = self.step.jobs.get(request.job_id)
        return job is None or job.turns_finished == 0
