"""The policy contract: what the runtime asks of a policy, and in what order.

A policy is one class with every attribute and hook of :class:`Policy`. It subclasses
``sidecar.policies.base.NativePolicy`` (vLLM's own behaviour at every hook) and
overrides the hooks where it differs: ``fcfs`` overrides none of the seven below,
``llmd-ttl`` two, ``continuum`` six, ``adaptive`` all seven; a policy that keeps state
per engine also overrides ``forget_engine``. A hook left alone keeps vLLM's
semantics, so a partial policy is a complete, safe one.
docs/policies.md has a complete small policy, which the contract suite runs.

For each step report, the runtime (``sidecar.runtime.decider.Decider.decide``) reads
the class attributes ``name``, ``pins_finished_requests`` and ``reads_waiting_demand``
and calls the hooks in this order, each once unless said otherwise:

1. ``caches_provisional_pins(step)``;
2. ``on_finish(finished)``: once per request that finished since the last report, in
   the order reported; the view the next call sees holds the pins this one made or
   released;
3. ``expire(step)``, then ``release_under_pressure(step)``: the pins the first
   releases are gone from the view the second sees;
4. ``order_waiting(step)``, then ``order_victims(step)``;
5. ``order_pins_under_pressure(step)``.

``forget_engine(engine_id)`` is called apart from steps, once an engine has been
silent for ``engine_forget_after_s``.

Contracts shared by every hook (``tests/unit/test_policy_contract.py`` checks them
against every registered policy and the example in docs/policies.md):
- called on the daemon's decision path: fast, no I/O, no store access, no clock but
  the step's ``now_s``, no randomness;
- called on the daemon's event-loop thread, one call at a time (``forget_engine``
  too): a policy needs no lock;
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
class Policy(Protocol):
    """A complete policy: the three attributes the runtime reads and the hooks it
    calls, in the order above. Build one by subclassing ``NativePolicy`` and
    overriding the hooks that differ from vLLM."""

    name: str
    # Whether the engine should hold a finished non-last-step request's blocks until
    # the daemon has decided (a provisional pin). False keeps vLLM's free-at-once.
    pins_finished_requests: bool
    # Whether the policy reads ``KvView.waiting_demand_blocks``: the plugin counts it
    # only for a policy that does.
    reads_waiting_demand: bool

    def caches_provisional_pins(self, step: StepView) -> bool:
        """With ``pins_finished_requests``: whether the engine keeps the blocks of the
        turns that finish before its next decision cached at the top retention
        priority (True) instead of held (False) while the daemon decides on their pins,
        so that no allocation waits on the answer (vllm_plugin/provisional.py).
        ``step.late_answer_share`` says how late the engine's answers land."""
        ...

    def on_finish(self, finished: FinishInput) -> RetainDecision:
        """What to do with a finished request's KV blocks: pin for a TTL, release
        them at once, or release them at a retention priority; and which older pins
        of its job it replaces."""
        ...

    def expire(self, step: StepView) -> PinRelease:
        """Pins whose time is up at ``step.now_s``."""
        ...

    def release_under_pressure(self, step: StepView) -> PinRelease:
        """Pins to give up because memory is short (e.g. Continuum's steal when at most
        one request runs); no ids when nothing is short."""
        ...

    def order_waiting(self, step: StepView) -> Ordering:
        """Waiting request ids, first to be admitted first. Must be a permutation of
        ``step.waiting``; the runtime maps positions onto vLLM's ``Request.priority``,
        where they order requests of one client priority (the client's comes first)."""
        ...

    def order_victims(self, step: StepView) -> Ordering:
        """Running request ids, first to be preempted first, when the engine runs out
        of KV blocks. Must be a permutation of ``step.running``."""
        ...

    def order_pins_under_pressure(self, step: StepView) -> PressureOrder:
        """Pins the engine may release, first first, when an allocation for a running
        request fails, *before* vLLM preempts one. Pins left out are kept (vLLM
        preempts instead). The engine applies this between decisions, without asking,
        and only while its running count is within ``max_running``."""
        ...

    def forget_engine(self, engine_id: str) -> None:
        """Drop the per-engine state the policy keeps about ``engine_id``: the engine
        left (no session, silent for ``engine_forget_after_s``). Engine ids come and go
        with pods; an engine that reports again is learned again."""
        ...
