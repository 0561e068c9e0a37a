"""Contracts between the kvtether runtime and its policies.

Protocols and frozen dataclasses only: no gRPC, no Redis, no runtime imports
(``tests/unit/test_layering.py`` checks this).
"""

from sidecar.framework.protocols import (
    FinishedTurnWait,
    FinishRetention,
    PinExpiry,
    PinsUnderPressure,
    Policy,
    PressureRelief,
    VictimOrder,
    WaitingOrder,
)
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
    "FinishRetention",
    "FinishedTurnWait",
    "JobView",
    "KvView",
    "Ordering",
    "PinExpiry",
    "PinRelease",
    "PinView",
    "PinsUnderPressure",
    "Policy",
    "PressureOrder",
    "PressureRelief",
    "RequestState",
    "RequestView",
    "RetainAction",
    "RetainDecision",
    "StepScratch",
    "StepView",
    "ToolTimeDistribution",
    "VictimOrder",
    "WaitingOrder",
]
