"""Every policy, registered by name in one place (like vLLM's ``create_request_queue``
and llm-d's ``RegisterAllPlugins``).

Adding a policy: write ``sidecar/policies/<name>/`` (policy, params, README) and add
one ``PolicySpec`` to ``_SPECS`` below (docs/policies.md, "Adding a policy"). The
daemon, the ``kvtether`` CLI, the contract suite and the twin's ``run`` and ``sweep``
take the names from here.

Configuration errors surface at start-up as :class:`PolicyConfigError`, naming the
policy and the parameter: a bad configuration stops the daemon, it is never silently
replaced by defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from sidecar.framework.protocols import Policy
from sidecar.policies.adaptive.params import AdaptiveParams
from sidecar.policies.adaptive.policy import AdaptivePolicy
from sidecar.policies.base import PolicyParams
from sidecar.policies.contextserve.policy import ContextServeParams, ContextServePolicy
from sidecar.policies.continuum.policy import ContinuumParams, ContinuumPolicy
from sidecar.policies.fcfs.policy import FcfsParams, FcfsPolicy
from sidecar.policies.llmd_ttl.policy import LlmdTtlParams, LlmdTtlPolicy


class PolicyConfigError(ValueError):
    """An unknown policy name or an invalid parameter."""


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    params_model: type[PolicyParams]
    # Builds the policy from validated parameters of ``params_model``.
    factory: Callable[[PolicyParams], Policy]
    summary: str


_SPECS = (
    PolicySpec("fcfs", FcfsParams, FcfsPolicy, "vLLM's native FCFS; never pins"),
    PolicySpec(
        "continuum",
        ContinuumParams,
        ContinuumPolicy,
        "Continuum: job-level FCFS, pinned jobs first, TTL pins (fixed or CDF)",
    ),
    PolicySpec(
        "contextserve",
        ContextServeParams,
        ContextServePolicy,
        "ContextServe: FAST pin / SLOW release / UNCERTAIN Bayesian TTL",
    ),
    PolicySpec(
        "adaptive",
        AdaptiveParams,
        AdaptivePolicy,
        "pins and admissions valued every step (tool time given elapsed, memory "
        "pressure, recompute cost); bounded waiting",
    ),
    PolicySpec(
        "llmd-ttl",
        LlmdTtlParams,
        LlmdTtlPolicy,
        "llm-d's retention baseline: every job's turn cached at priority 70 for the "
        "0.9 quantile of a log-normal fit of inter-turn gaps; vLLM's order, no pins",
    ),
)
_REGISTRY: dict[str, PolicySpec] = {spec.name: spec for spec in _SPECS}


def available_policies() -> tuple[str, ...]:
    """Registered policy names, in registration order."""
    return tuple(_REGISTRY)


def policy_spec(name: str) -> PolicySpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise PolicyConfigError(
            f"Unknown scheduling policy: {name!r}; known policies: "
            + ", ".join(available_policies())
        )
    return spec


def build_policy(name: str, params: Mapping[str, object]) -> Policy:
    """Validate ``params`` for policy ``name`` and build it.

    Raises PolicyConfigError on an unknown name (listing the known ones) or on any
    invalid parameter (naming the policy and every bad parameter)."""
    spec = policy_spec(name)
    try:
        validated = spec.params_model.model_validate(dict(params))
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or '(params)'}: {e['msg']}"
            for e in error.errors()
        )
        raise PolicyConfigError(f"policy {name!r}: invalid parameter {problems}") from error
    return spec.factory(validated)


def policy_parameters(policy: Policy) -> dict[str, object]:
    """A built policy's effective parameters (defaults filled in), as plain JSON-able
    values, for logging at start-up and for inspection."""
    params = getattr(policy, "params", None)
    if isinstance(params, PolicyParams):
        dumped: dict[str, object] = params.model_dump(mode="json")
        return dumped
    return {}


def policy_parameters_schema(name: str) -> dict[str, object]:
    """JSON schema of a policy's parameters (names, types, defaults, bounds)."""
    schema: dict[str, object] = policy_spec(name).params_model.model_json_schema()
    return schema
