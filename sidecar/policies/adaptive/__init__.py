from sidecar.policies.adaptive.policy import AdaptiveParams, AdaptivePolicy

__all__ = ["AdaptiveParams", "AdaptivePolicy"]
