from sidecar.policies.adaptive.params import AdaptiveParams
from sidecar.policies.adaptive.policy import AdaptivePolicy

__all__ = ["AdaptiveParams", "AdaptivePolicy"]
