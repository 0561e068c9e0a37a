"""Policies are built by name with validated parameters; mistakes stop start-up."""

from __future__ import annotations

import inspect

import pytest

from sidecar.framework.protocols import Policy
from sidecar.policies.registry import (
    PolicyConfigError,
    available_policies,
    build_policy,
    policy_parameters,
    policy_parameters_schema,
)


def test_registered_policies() -> None:
    assert available_policies() == ("fcfs", "continuum", "contextserve", "adaptive",
                                    "llmd-ttl")


@pytest.mark.parametrize("name", ["fcfs", "continuum", "contextserve", "adaptive",
                                  "llmd-ttl"])
def test_every_policy_builds_with_defaults_and_implements_every_hook(name: str) -> None:
    policy = build_policy(name, {})
    # Every hook of the contract, callable as the runtime calls it: the same
    # parameters (names, kinds) as the Protocol declares. (A runtime-checkable
    # Protocol's isinstance checks only that the names exist.) What the hooks answer
    # is tests/unit/test_policy_contract.py's.
    hooks = [member for member in dir(Policy) if not member.startswith("_")
             and inspect.isfunction(getattr(Policy, member))]
    assert {"order_waiting", "on_finish", "caches_provisional_pins"} <= set(hooks)
    for hook in hooks:
        declared = list(inspect.signature(getattr(Policy, hook)).parameters.values())[1:]
        implemented = list(inspect.signature(getattr(policy, hook)).parameters.values())
        assert [(p.name, p.kind) for p in implemented] == [
            (p.name, p.kind) for p in declared], hook
    assert isinstance(policy.pins_finished_requests, bool)
    assert isinstance(policy.reads_waiting_demand, bool)
    assert policy.name == name
    # Defaults are visible for inspection and round-trip into an equal policy.
    assert policy_parameters(build_policy(name, policy_parameters(policy))) == (
        policy_parameters(policy)
    )
    assert "properties" in policy_parameters_schema(name)


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(PolicyConfigError, match="Unknown scheduling policy: 'lifo'") as error:
        build_policy("lifo", {})
    assert "fcfs, continuum, contextserve" in str(error.value)
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize(
    ("name", "params", "named"),
    [
        ("fcfs", {"ttl_s": 1}, "ttl_s"),
        ("continuum", {"fixed_ttl_s": -1.0}, "fixed_ttl_s"),
        ("continuum", {"ttl_mode": "magic"}, "ttl_mode"),
        ("continuum", {"fixed_ttl_s": float("nan")}, "fixed_ttl_s"),
        ("continuum", {"candidate_quantiles": [0.5, 1.5]}, "candidate_quantiles"),
        ("continuum", {"candidate_quantiles": []}, "candidate_quantiles"),
        ("continuum", {"min_samples": 0}, "min_samples"),
        ("continuum", {"fixed_tll_s": 2.0}, "fixed_tll_s"),  # misspelt: not ignored
        ("contextserve", {"uncertain_quantile": 1.0}, "uncertain_quantile"),
        ("contextserve", {"prior_alpha": 0}, "prior_alpha"),
        ("contextserve", {"fast_commands": ["  "]}, "fast_commands"),
        ("llmd-ttl", {"quantile": 1.0}, "quantile"),
        ("llmd-ttl", {"min_retention_s": 700}, "min_retention_s"),
        ("llmd-ttl", {"priority": 101}, "priority"),
    ],
)
def test_bad_parameter_names_policy_and_parameter(
    name: str, params: dict[str, object], named: str
) -> None:
    with pytest.raises(PolicyConfigError) as error:
        build_policy(name, params)
    assert f"policy {name!r}" in str(error.value)
    assert named in str(error.value)


def test_parameters_are_applied_and_reported() -> None:
    policy = build_policy("continuum", {"ttl_mode": "cdf", "fixed_ttl_s": 5})
    params = policy_parameters(policy)
    assert params["ttl_mode"] == "cdf"
    assert params["fixed_ttl_s"] == 5.0
    assert params["min_samples"] == 5  # default filled in


def test_contextserve_tables_are_normalised_like_tool_calls() -> None:
    policy = build_policy(
        "contextserve", {"fast_commands": ["/bin/ls -la"], "slow_prefixes": ["python -m pytest"]}
    )
    params = policy_parameters(policy)
    assert params["fast_commands"] == ["ls"]
    assert params["slow_prefixes"] == ["pytest"]


def test_contextserve_rejects_a_command_both_fast_and_slow() -> None:
    with pytest.raises(PolicyConfigError, match=r"both fast and slow: .*git status"):
        build_policy("contextserve", {"slow_prefixes": ["git"]})
