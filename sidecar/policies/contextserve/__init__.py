from sidecar.policies.contextserve.policy import (
    ContextServeParams,
    ContextServePolicy,
    ToolSpeed,
)

__all__ = ["ContextServeParams", "ContextServePolicy", "ToolSpeed"]
