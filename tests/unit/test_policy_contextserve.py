"""contextserve: FAST pin / SLOW release / UNCERTAIN Bayesian TTL, Continuum otherwise."""

from __future__ import annotations

import math
import random

import pytest

from sidecar.framework.protocols import Policy
from sidecar.framework.types import RetainAction
from sidecar.policies.contextserve.policy import ContextServePolicy, ToolSpeed
from sidecar.policies.registry import build_policy
from tests.unit.builders import step


@pytest.fixture
def contextserve() -> Policy:
    return build_policy("contextserve", {})


@pytest.mark.parametrize(
    ("tool", "speed"),
    [
        ("ls", ToolSpeed.FAST),
        ("cat", ToolSpeed.FAST),
        ("pwd", ToolSpeed.FAST),
        ("git status", ToolSpeed.FAST),
        ("pytest", ToolSpeed.SLOW),
        ("pip install", ToolSpeed.SLOW),
        ("make", ToolSpeed.SLOW),
        ("docker build", ToolSpeed.SLOW),
        ("python -m pytest -x tests/", ToolSpeed.SLOW),  # a client hint, not yet a key
        ("pip list", ToolSpeed.UNCERTAIN),  # "pip install" is a prefix on words only
        ("git push", ToolSpeed.UNCERTAIN),
        ("search_web", ToolSpeed.UNCERTAIN),
        (None, ToolSpeed.UNCERTAIN),
    ],
)
def test_classifies_by_rule_tables(
    contextserve: Policy, tool: str | None, speed: ToolSpeed
) -> None:
    assert isinstance(contextserve, ContextServePolicy)
    assert contextserve.classify(tool) is speed


def test_fast_tool_is_pinned_for_the_fast_ttl(contextserve: Policy) -> None:
    s = step().running("r", job="a")
    decision = contextserve.on_finish(s.finish("r", tool="git status"))
    assert (decision.action, decision.ttl_s) == (RetainAction.PIN, 3.0)
    assert "FAST" in decision.reason


def test_slow_tool_is_released_at_once_even_if_measured_fast(contextserve: Policy) -> None:
    s = step().running("r", job="a").pin("old", job="a")
    decision = contextserve.on_finish(s.finish("r", tool="pytest", samples_s=[0.1] * 20))
    assert decision.action is RetainAction.RELEASE
    assert decision.release_pins == ("old",)
    assert "SLOW" in decision.reason


def test_uncertain_tool_pins_for_its_posterior_quantile(contextserve: Policy) -> None:
    # ln(duration) ~ Normal(ln 0.5, 0.3): the true 0.9 quantile is 0.5 * e^(1.2816*0.3).
    rng = random.Random(7)
    samples = [math.exp(rng.gauss(math.log(0.5), 0.3)) for _ in range(400)]
    s = step().running("r", job="a")
    decision = contextserve.on_finish(s.finish("r", tool="search_web", samples_s=samples))
    assert decision.action is RetainAction.PIN
    assert decision.ttl_s == pytest.approx(0.5 * math.exp(1.2816 * 0.3), rel=0.05)
    assert "UNCERTAIN" in decision.reason


def test_uncertain_ttl_is_longer_when_fewer_samples_are_known(contextserve: Policy) -> None:
    s = step().running("r", job="a")
    few = contextserve.on_finish(s.finish("r", tool="t", samples_s=[0.4, 0.5, 0.6]))
    many = contextserve.on_finish(s.finish("r", tool="t", samples_s=[0.4, 0.5, 0.6] * 30))
    assert few.action is many.action is RetainAction.PIN
    assert few.ttl_s > many.ttl_s > 0.6


def test_uncertain_tool_with_few_samples_falls_back_to_continuum(contextserve: Policy) -> None:
    s = step().running("r", job="a")
    # Two samples (< bayes_min_samples=3), mean 0.5 s <= 2 s: Continuum's fixed 2 s pin.
    decision = contextserve.on_finish(s.finish("r", tool="search_web", samples_s=[0.4, 0.6]))
    assert (decision.action, decision.ttl_s) == (RetainAction.PIN, 2.0)
    assert "too few samples" in decision.reason
    slow = contextserve.on_finish(s.finish("r", tool="search_web", samples_s=[5.0, 6.0]))
    assert slow.action is RetainAction.RELEASE


def test_uncertain_tool_slower_than_max_ttl_is_released(contextserve: Policy) -> None:
    s = step().running("r", job="a")
    decision = contextserve.on_finish(s.finish("r", tool="train", samples_s=[100.0] * 10))
    assert decision.action is RetainAction.RELEASE
    assert "max_ttl_s" in decision.reason


def test_no_tool_and_last_step_release(contextserve: Policy) -> None:
    s = step().running("plain", job="a").running("last", job="b", last=True)
    assert contextserve.on_finish(s.finish("plain")).action is RetainAction.RELEASE
    assert contextserve.on_finish(s.finish("last", tool="ls")).action is RetainAction.RELEASE


def test_tables_are_configurable() -> None:
    policy = build_policy(
        "contextserve",
        {"fast_commands": ["make"], "slow_prefixes": ["ls"], "fast_ttl_s": 1.5},
    )
    s = step().running("r", job="a")
    assert policy.on_finish(s.finish("r", tool="make")).ttl_s == 1.5
    assert policy.on_finish(s.finish("r", tool="ls")).action is RetainAction.RELEASE


def test_keeps_continuums_scheduling(contextserve: Policy) -> None:
    s = (
        step(now=10)
        .waiting("b1", job="b", arrive=1.0)
        .waiting("a1", job="a", arrive=3.0)
        .pin("p-a", job="a", expires=5.0)
    )
    assert list(contextserve.order_waiting(s.build()).request_ids) == ["a1", "b1"]
    assert list(contextserve.expire(s.build()).request_ids) == []  # job a waits
