from sidecar.policies.fcfs.policy import FcfsParams, FcfsPolicy

__all__ = ["FcfsParams", "FcfsPolicy"]
