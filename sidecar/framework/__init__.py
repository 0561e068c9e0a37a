"""Contracts between the kvtether runtime and its policies.

Protocols and frozen dataclasses only: no gRPC, no Redis, no runtime imports
(``tests/unit/test_layering.py`` checks this).
"""

from sidecar.framework.protocols import Policy
from sidecar.framework.types import (
    EngineCost,
    FinishInput,
    JobView,
    KvView,
    Ordering,
    PinRelease,
    PinView,
    PressureOrder,
    RequestState,
    RequestView,
    RetainAction,
    RetainDecision,
    StepScratch,
    StepView,
    ToolTimeDistribution,
)

__all__ = [
    "EngineCost",
    "FinishInput",
    "JobView",
    "KvView",
    "Ordering",
    "PinRelease",
    "PinView",
    "Policy",
    "PressureOrder",
    "RequestState",
    "RequestView",
    "RetainAction",
    "RetainDecision",
    "StepScratch",
    "StepView",
    "ToolTimeDistribution",
]
