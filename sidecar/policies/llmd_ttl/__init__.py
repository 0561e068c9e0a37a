from sidecar.policies.llmd_ttl.policy import LlmdTtlParams, LlmdTtlPolicy

__all__ = ["LlmdTtlParams", "LlmdTtlPolicy"]
