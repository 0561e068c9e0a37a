"""Policies: ``base.NativePolicy`` (vLLM's behaviour) and one folder per policy, all
registered by name in ``registry``. Policies see plain data only (no store, no gRPC)."""

from sidecar.policies.base import NativePolicy, PolicyParams
from sidecar.policies.registry import (
    PolicyConfigError,
    available_policies,
    build_policy,
    policy_parameters,
    policy_parameters_schema,
)

__all__ = [
    "NativePolicy",
    "PolicyConfigError",
    "PolicyParams",
    "available_policies",
    "build_policy",
    "policy_parameters",
    "policy_parameters_schema",
]
