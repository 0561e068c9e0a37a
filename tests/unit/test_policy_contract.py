"""The policy contract (sidecar/framework/protocols.py), checked against every
registered policy with its default parameters, and against the complete small policy
docs/policies.md shows a newcomer: what the runtime and the digital twin rely on
whichever policy a user picks or writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.framework.protocols import Policy
from sidecar.framework.types import (
    FinishInput,
    Ordering,
    PinRelease,
    PressureOrder,
    RetainAction,
    RetainDecision,
    StepView,
)
from sidecar.policies.base import NativePolicy
from sidecar.policies.registry import available_policies, build_policy
from tests.unit.builders import StepBuilder, step

FAST = [0.08, 0.1, 0.12, 0.09, 0.11, 0.1]
SLOW = [10.0, 12.0, 14.0, 11.0, 13.0, 12.5]

ROOT = Path(__file__).resolve().parents[2]
# The policy written out in docs/policies.md, "Adding a policy".
DOCUMENTED = "docs/policies.md example"
POLICIES = [*available_policies(), DOCUMENTED]


def documented_code() -> str:
    """The first Python block of docs/policies.md's "Adding a policy"."""
    text = (ROOT / "docs" / "policies.md").read_text(encoding="utf-8")
    section = text[text.index("## Adding a policy"):]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def documented_policy() -> Policy:
    """The documented policy, its code run as written, built with default parameters."""
    namespace: dict[str, object] = {"__name__": "documented_policy"}
    exec(compile(documented_code(), "docs/policies.md", "exec"), namespace)
    (policy_class,) = [value for value in namespace.values() if isinstance(value, type)
                       and issubclass(value, NativePolicy) and value is not NativePolicy]
    policy: Policy = policy_class()
    return policy


def make(name: str) -> Policy:
    return documented_policy() if name == DOCUMENTED else build_policy(name, {})


def _busy(now: float = 20.0, free_blocks: int = 0) -> StepBuilder:
    """Memory short, a backlog, pins of fast and slow tools, a job holding a pin with
    its next turn waiting, a last step running, and ties: requests arriving at the
    same instant for jobs that started at the same instant."""
    s = (step(now=now, total_blocks=200, free_blocks=free_blocks)
         .times("ls", FAST).times("make", SLOW)
         .pin("p-ls", job="a", blocks=10, pinned_at=now - 0.05, expires=now + 2, tool="ls")
         .pin("p-make", job="b", blocks=30, pinned_at=now - 1.0, expires=now + 30, tool="make")
         .pin("p-old", job="c", blocks=5, pinned_at=now - 40.0, expires=now - 1, tool="ls")
         .waiting("a-2", job="a", arrive=now - 0.02, prompt=400)
         .running("r-last", job="d", arrive=now - 3.0, prompt=320, last=True)
         .running("r-1", job="e", arrive=now - 2.0, prompt=640)
         .running("r-2", job="e", arrive=now - 2.0, prompt=640)
         .job("a", first_arrival=1.0, turns=1).job("b", first_arrival=2.0, turns=1)
         .job("c", first_arrival=3.0, turns=1).job("d", first_arrival=4.0, turns=2)
         .job("e", first_arrival=5.0, turns=1))
    for i in range(6):  # ties: same arrival, jobs of the same first arrival
        s.waiting(f"t-{i}", job=f"t{i}", arrive=now - 5.0, prompt=160).job(f"t{i}", now - 5.0)
    for k in range(6):  # waits from 1 to 32 s: some past a bound on waiting, some not
        s.waiting(f"w-{k}", job=f"w{k}", arrive=now - 2.0**k, prompt=64).job(f"w{k}", now - 2.0**k)
    return s


SCENARIOS: dict[str, Callable[[], StepBuilder]] = {
    "memory short": _busy,
    "memory idle": lambda: _busy(free_blocks=200),
    "stalled": lambda: _busy().stalled(),
    "empty": lambda: step(now=5.0),
}


def _decide(policy: Policy, view: StepView) -> tuple[object, ...]:
    """Every per-step hook's answer and reason, in the order the runtime calls them,
    on fresh copies of ``view`` (as the runtime derives one when pins change)."""
    answers: list[object] = [policy.caches_provisional_pins(replace(view))]
    for hook in (policy.expire, policy.release_under_pressure):
        release = hook(replace(view))  # a set of pins: its order means nothing
        answers.append((sorted(release.request_ids), dict(release.retention_priorities),
                        release.reason))
    last = replace(view)
    for ordering in (policy.order_waiting(last), policy.order_victims(last)):
        answers.append((tuple(ordering.request_ids), ordering.reason))
    pressure = policy.order_pins_under_pressure(last)
    answers.append((tuple(pressure.request_ids), pressure.max_running, pressure.reason))
    return tuple(answers)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_orders_are_permutations_and_releases_name_pins(name: str, scenario: str) -> None:
    policy = make(name)
    view = SCENARIOS[scenario]().build()
    waiting = policy.order_waiting(view)
    victims = policy.order_victims(view)
    assert isinstance(waiting, Ordering) and isinstance(victims, Ordering)
    assert sorted(waiting.request_ids) == sorted(r.request_id for r in view.waiting)
    assert sorted(victims.request_ids) == sorted(r.request_id for r in view.running)
    pin_ids = {p.request_id for p in view.pins}
    for release in (policy.expire(view), policy.release_under_pressure(view)):
        assert isinstance(release, PinRelease)
        assert len(set(release.request_ids)) == len(release.request_ids) <= len(pin_ids)
        assert set(release.request_ids) <= pin_ids
        assert set(release.retention_priorities) <= set(release.request_ids)
        assert all(0 <= p <= 100 for p in release.retention_priorities.values())
    pressure = policy.order_pins_under_pressure(view)
    assert isinstance(pressure, PressureOrder)
    assert len(set(pressure.request_ids)) == len(pressure.request_ids)
    assert set(pressure.request_ids) <= pin_ids
    assert isinstance(policy.caches_provisional_pins(view), bool)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ties_break_the_same_whatever_order_the_requests_come_in(
        name: str, scenario: str) -> None:
    view = SCENARIOS[scenario]().build()
    shuffled = replace(view, waiting=tuple(reversed(view.waiting)),
                       running=tuple(reversed(view.running)), pins=tuple(reversed(view.pins)))
    assert _decide(make(name), view) == _decide(make(name), shuffled)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_same_step_twice_gets_the_same_answer(name: str, scenario: str) -> None:
    policy = make(name)
    # A history first, so that a policy's per-engine state is not fresh: a request
    # admitted every 2 s for 16 s, the step's requests new to it.
    for tick in range(8):
        now = 3.0 + 2.0 * tick
        _decide(policy, step(now=now, total_blocks=200, free_blocks=0)
                .waiting(f"hw-{tick}", job=f"hw{tick}", arrive=now)
                .running(f"h-{tick}", job=f"h{tick}", arrive=now).build())
    view = SCENARIOS[scenario]().build()
    first = _decide(policy, view)
    assert _decide(policy, view) == first, "the same step view again"
    assert _decide(policy, replace(view)) == first, "an equal step, seen anew"


@pytest.mark.parametrize("name", POLICIES)
def test_releasing_twice_is_harmless(name: str) -> None:
    policy = make(name)
    view = _busy().build()
    released: set[str] = set()
    for release in (policy.expire(view), policy.release_under_pressure(view)):
        released |= set(release.request_ids)
    # Asked again on the same step: the same pins, nothing else, no error.
    again: set[str] = set()
    for release in (policy.expire(replace(view)), policy.release_under_pressure(replace(view))):
        again |= set(release.request_ids)
    assert again == released
    # The next step no longer holds them: no hook names them again.
    later = replace(view, now_s=view.now_s + 0.01,
                    pins=tuple(p for p in view.pins if p.request_id not in released))
    for release in (policy.expire(later), policy.release_under_pressure(later)):
        assert not set(release.request_ids) & released
    assert not set(policy.order_pins_under_pressure(later).request_ids) & released


def _finish(s: StepBuilder, request_id: str, tool: str | None = "ls") -> FinishInput:
    return s.finish(request_id, tool=tool, samples_s=FAST if tool == "ls" else SLOW,
                    global_samples_s=FAST + SLOW, blocks=10)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("scenario", ["memory short", "memory idle", "stalled"])
def test_a_last_step_is_never_pinned(name: str, scenario: str) -> None:
    policy = make(name)
    s = SCENARIOS[scenario]().pin("d-old", job="d", blocks=3, pinned_at=15.0, tool="ls")
    for tool in ("ls", "make", None):
        decision = policy.on_finish(_finish(s, "r-last", tool))
        assert isinstance(decision, RetainDecision)
        assert decision.action is not RetainAction.PIN and decision.ttl_s == 0.0, tool
        assert decision.release_pins == ("d-old",), "the job's older pin goes with it"


@pytest.mark.parametrize("name", POLICIES)
def test_requests_without_a_job_and_concurrent_requests_of_one_job(name: str) -> None:
    """A request with no job id is a job of its own (the runtime gives it its own id);
    two requests of one job may run at once. Each finish supersedes only its own
    job's older pins."""
    policy = make(name)
    s = (_busy(free_blocks=200)
         .running("anon-1", job=None, arrive=18.0).running("anon-2", job=None, arrive=18.0)
         .pin("e-old", job="e", blocks=4, pinned_at=10.0, tool="ls"))
    view = s.build()
    assert sorted(policy.order_victims(view).request_ids) == sorted(
        r.request_id for r in view.running)
    for request_id in ("anon-1", "anon-2"):
        assert policy.on_finish(_finish(s, request_id)).release_pins == ()
    first = policy.on_finish(_finish(s, "r-1"))
    second = policy.on_finish(_finish(s.pin("r-1", job="e", blocks=10, pinned_at=20.0,
                                            tool="ls"), "r-2"))
    assert first.release_pins == ("e-old",)
    assert set(second.release_pins) == {"e-old", "r-1"}, "at most one pin per job survives"


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("scenario", ["memory short", "memory idle", "stalled"])
def test_a_request_with_no_job_is_left_to_vllms_order(name: str, scenario: str) -> None:
    """One-shot traffic is one-shot (docs/decisions/022): a request sent with no job id
    and no session has no next turn, so whatever tool its answer names and whatever
    the tools' measured times say, no policy pins it or caches it above vLLM's own
    priority (35), where it would outrank a client's directive."""
    policy = make(name)
    s = SCENARIOS[scenario]().running("once", job=None, arrive=19.0, prompt=450)
    for tool in ("ls", "make", None):
        decision = policy.on_finish(_finish(s, "once", tool))
        assert decision.action is not RetainAction.PIN and decision.ttl_s == 0.0, tool
        assert decision.retention_priority is None, (tool, decision.reason)


def test_the_documented_policy_is_a_small_complete_one() -> None:
    """What docs/policies.md promises a newcomer: about forty lines make a policy the
    runtime can run (its hooks the rest of this suite checks)."""
    assert len(documented_code().splitlines()) <= 50
    policy = documented_policy()
    assert isinstance(policy, Policy) and policy.name == "fixed-pin"
    assert policy.pins_finished_requests and not policy.reads_waiting_demand
