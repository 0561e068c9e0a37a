from sidecar.policies.continuum.policy import ContinuumParams, ContinuumPolicy

__all__ = ["ContinuumParams", "ContinuumPolicy"]
