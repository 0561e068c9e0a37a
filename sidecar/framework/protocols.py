"""One small interface per extension point, in the spirit of Kubernetes' scheduling
framework (QueueSort / Filter / Score / Reserve): a policy implements the one to
three it cares about and inherits vLLM's behaviour for the rest from
``sidecar.policies.base.NativePolicy``.

Contracts shared by every hook (``tests/unit/test_policy_contract.py`` checks them
against every registered policy):
- called on the daemon's decision path: fast, no I/O, no store access, no clock but
  the step's ``now_s``, no randomness;
- inputs are frozen plain data (``sidecar.framework.types``); what one hook of a step
  computes for another goes in the step's ``scratch``, never in a cache matched by
  object identity;
- a policy may keep state per engine that outlives a step (adaptive's forecasts),
  fed by that engine's steps in the order they come: given the same steps in the
  same order, a policy answers the same, so the digital twin replays it exactly, and
  the same step seen twice gets the same answer;
- orders are permutations of their input, ties broken by request id;
- releasing a pin that is already released is harmless (idempotent).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sidecar.framework.types import (
    FinishInput,
    Ordering,
    PinRelease,
    PressureOrder,
    RetainDecision,
    StepView,
)


@runtime_checkable
class WaitingOrder(Protocol):
    def order_waiting(self, step: StepView) -> Ordering:
        """Waiting request ids, first to be admitted first. Must be a permutation of
        ``step.waiting``; the runtime maps positions onto vLLM's ``Request.priority``,
        where they order requests of one client priority (the client's comes first)."""
        ...


@runtime_checkable
class VictimOrder(Protocol):
    def order_victims(self, step: StepView) -> Ordering:
        """Running request ids, first to be preempted first, when the engine runs out
        of KV blocks. Must be a permutation of ``step.running``."""
        ...


@runtime_checkable
class FinishRetention(Protocol):
    def on_finish(self, finished: FinishInput) -> RetainDecision:
        """What to do with a finished request's KV blocks: pin for a TTL, release
        them at once, or release them at a retention priority."""
        ...


@runtime_checkable
class PressureRelief(Protocol):
    def release_under_pressure(self, step: StepView) -> PinRelease:
        """Pins to give up because memory is short (e.g. Continuum's steal when at most
        one request runs). Called every step; return no ids when nothing is short."""
        ...


@runtime_checkable
class PinsUnderPressure(Protocol):
    def order_pins_under_pressure(self, step: StepView) -> PressureOrder:
        """Pins the engine may release, first first, when an allocation for a running
        request fails, *before* vLLM preempts one. Pins left out are kept (vLLM
        preempts instead). The engine applies this between decisions, without asking,
        and only while its running count is within ``max_running``."""
        ...


@runtime_checkable
class PinExpiry(Protocol):
    def expire(self, step: StepView) -> PinRelease:
        """Pins whose time is up at ``step.now_s``. Called every step."""
        ...


@runtime_checkable
class FinishedTurnWait(Protocol):
    def caches_provisional_pins(self, step: StepView) -> bool:
        """With ``pins_finished_requests``: whether the engine keeps the blocks of the
        turns that finish before its next decision cached at the top retention
        priority (True) instead of held (False) while the daemon decides on their pins,
        so that no allocation waits on the answer (vllm_plugin/provisional.py). Asked
        once per decision, before ``on_finish``; ``step.late_answer_share`` says how
        late the engine's answers land."""
        ...


@runtime_checkable
class Policy(
    WaitingOrder,
    VictimOrder,
    FinishRetention,
    PressureRelief,
    PinsUnderPressure,
    PinExpiry,
    FinishedTurnWait,
    Protocol,
):
    """A complete policy: every extension point. Build one by subclassing
    ``NativePolicy`` and overriding the hooks that differ from vLLM."""

    name: str
    # Whether the engine should hold a finished non-last-step request's blocks until
    # the daemon has decided (a provisional pin). False keeps vLLM's free-at-once.
    pins_finished_requests: bool
    # Whether the policy reads ``KvView.waiting_demand_blocks``: the plugin counts it
    # only for a policy that does.
    reads_waiting_demand: bool

    def forget_engine(self, engine_id: str) -> None:
        """Drop the per-engine state the policy keeps about ``engine_id``: the engine
        left (no session, silent for ``engine_forget_after_s``). Engine ids come and go
        with pods; an engine that reports again is learned again."""
        ...
