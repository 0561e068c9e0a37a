"""``adaptive`` decides exactly as it did when the golden digests were written: the
admission order, the preemption victims, every pin, soft retention, release and
expiry with its retention priority, the pressure order and each reason Explain shows,
step by step along seeded step sequences (``tests/support/adaptive_trace.py``).

A change meant to make the policy cheaper must leave this green. A change meant to
alter its decisions regenerates the digests (``python -m tests.support.adaptive_trace
--write``) and says why in its commit.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math

import pytest

from sidecar.policies.adaptive.value import (
    Valuation,
    best_plan,
    outlook_of,
    p_return_of,
    plan_value_s,
)
from sidecar.policies.registry import build_policy
from tests.support.adaptive_trace import GOLDEN, SCENARIOS, Scenario, run
from tests.unit.builders import distribution


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.name)
def test_adaptive_decides_as_the_golden_digests_say(scenario: Scenario) -> None:
    expected = json.loads(GOLDEN.read_text())[scenario.name]
    steps = 0
    for index, lines in enumerate(run(scenario)):
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
        assert digest == expected[index], (
            f"{scenario.name}: step {index} decided differently from the golden digest; "
            "this step's decisions now:\n" + "\n".join(lines))
        steps += 1
    assert steps == len(expected) == scenario.steps


def test_a_steps_state_is_freed_with_its_view_not_left_to_the_collector() -> None:
    """What adaptive keeps for a step (in the view's scratch) goes when the view does:
    left in a reference cycle, every report's views would wait for the daemon's
    garbage collector, which then took a large share of its CPU."""
    policy = build_policy("adaptive", {})
    scenario = SCENARIOS[1]
    steps = run(scenario, policy)
    for _ in range(40):  # a busy engine: pins, waiting requests, released contexts
        next(steps)
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            next(steps)
        assert gc.collect() == 0, "a step's views and state were left in a reference cycle"
    finally:
        gc.enable()


def test_a_pins_value_without_its_outlook_is_the_value_of_its_outlook() -> None:
    """Re-valuing a pin every step skips building the cold-start outlook; the value
    and P(back) must be the ones the outlook gives, to the last bit."""
    valuation = Valuation(1e-4, (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0), 0.5, 2.0)
    sampled = distribution("ls", [0.08, 0.1, 0.12, 0.5, 1.5, 3.0])
    for tool_times in (None, sampled):
        for elapsed_s in (0.0, 0.1, 0.3, 1.0, 1.999, 2.0, 2.5, 40.0):
            for price in (0.0, 0.3, 1.0):
                for blocks in (1, 40, 900):
                    outlook = outlook_of(valuation, tool_times, elapsed_s)
                    assert p_return_of(valuation, tool_times, elapsed_s) == outlook[-1][0]
                    expected = best_plan(valuation, outlook, blocks * 16, blocks, 1000, price)[0]
                    got = plan_value_s(valuation, tool_times, elapsed_s, blocks * 16, blocks,
                                       1000, price)
                    assert got == expected and math.copysign(1.0, got) == math.copysign(
                        1.0, expected), (tool_times, elapsed_s, price, blocks)
