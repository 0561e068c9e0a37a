"""``adaptive``: every step, each pin and each admission valued by expected cost and
benefit — the tool's measured time given how long it has run, the current memory
pressure, the recompute cost of the context — with job-level admission and a bound on
how long any request waits.

The hooks delegate to ``admission.py`` (the waiting order) and ``pins.py`` (pin
valuation); what they share within a step is a ``StepState`` in the step's scratch,
what outlives a step is the ``EngineMemory``. README.md beside this file has the rules
and the parameters.
"""

from __future__ import annotations

import operator
from typing import ClassVar

from sidecar.framework.types import (
    FinishInput,
    Ordering,
    PinRelease,
    PressureOrder,
    RetainAction,
    RetainDecision,
    StepView,
)
from sidecar.policies.adaptive import admission, pins
from sidecar.policies.adaptive.params import AdaptiveParams
from sidecar.policies.adaptive.reasons import Reason, Rule
from sidecar.policies.adaptive.state import EngineMemory, StepState
from sidecar.policies.adaptive.waiting import PinShare, answers_run_late
from sidecar.policies.base import NativePolicy, PolicyParams, has_no_job, job_level_victims

# AdaptiveParams is defined in params.py and importable from here too.
__all__ = ["AdaptiveParams", "AdaptivePolicy"]

_request_id = operator.attrgetter("request_id")
_VICTIMS_REASON = Reason(Rule.VICTIMS).text()


class AdaptivePolicy(NativePolicy):
    name = "adaptive"
    pins_finished_requests = True
    reads_waiting_demand = True  # the price of memory (value.memory_pressure)
    params_model: ClassVar[type[PolicyParams]] = AdaptiveParams
    params: AdaptiveParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._memory = EngineMemory(self.params)

    def _state(self, step: StepView) -> StepState:
        return step.scratch.get_or_create(
            self, lambda: StepState(self.params, self._memory, step))

    # --- per-engine state ---------------------------------------------------------------

    def forget_engine(self, engine_id: str) -> None:
        self._memory.forget(engine_id)

    def engines_known(self) -> frozenset[str]:
        """The engines this policy keeps state about (what ``forget_engine`` drops)."""
        return self._memory.engine_ids

    def caches_provisional_pins(self, step: StepView) -> bool:
        mode = self.params.provisional_cache
        if mode != "auto":
            return mode
        if answers_run_late(step.late_answer_share):
            return True
        share = self._memory.pin_shares.get(step.engine_id)
        return share is not None and share.caches()

    # --- admission and preemption ---------------------------------------------------------

    def order_waiting(self, step: StepView) -> Ordering:
        return admission.order_waiting(self._state(step))

    def order_victims(self, step: StepView) -> Ordering:
        """Continuum's: the newest non-last-step job first (its context is the
        smallest, so preempting it wastes least)."""
        state = self._state(step)
        if state.victims is None:
            state.victims = Ordering(tuple(map(_request_id, job_level_victims(step))),
                                     _VICTIMS_REASON)
        return state.victims

    # --- pins -----------------------------------------------------------------------------

    def on_finish(self, finished: FinishInput) -> RetainDecision:
        decision = pins.on_finish(self._state(finished.step), finished)
        request = finished.request
        # The share of finishes pinned counts the turns the engine holds: a job's.
        if (self.params.provisional_cache == "auto" and not request.is_last_step
                and not has_no_job(request)):
            share = self._memory.pin_shares.get(finished.step.engine_id)
            if share is None:
                share = self._memory.pin_shares[finished.step.engine_id] = PinShare()
            share.record(decision.action is RetainAction.PIN)
        return decision

    def release_under_pressure(self, step: StepView) -> PinRelease:
        return pins.release_under_pressure(self._state(step))

    def order_pins_under_pressure(self, step: StepView) -> PressureOrder:
        return pins.order_pins_under_pressure(self._state(step), self.order_victims(step))

    def expire(self, step: StepView) -> PinRelease:
        return pins.expire(self._state(step))
