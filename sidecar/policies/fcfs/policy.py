"""``fcfs``: vLLM's own order on the priority policy kvtether runs (the client's
priority, then arrival), the baseline and the fallback. Never pins."""

from __future__ import annotations

from typing import ClassVar

from sidecar.policies.base import NativePolicy, PolicyParams


class FcfsParams(PolicyParams):
    """``fcfs`` has no parameters: it is vLLM's own order."""


class FcfsPolicy(NativePolicy):
    name = "fcfs"
    params_model: ClassVar[type[PolicyParams]] = FcfsParams
