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

import pytest

from sidecar.policies.registry import build_policy
from tests.support.adaptive_trace import GOLDEN, SCENARIOS, Scenario, run


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
