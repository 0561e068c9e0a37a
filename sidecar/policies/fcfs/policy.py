"""``fcfs``: vLLM's native scheduling, the baseline and the fallback. Never pins."""

from __future__ import annotations

from typing import ClassVar

from sidecar.policies.base import NativePolicy, PolicyParams


class FcfsParams(PolicyParams):
    """``fcfs`` has no parameters: it is vLLM's behaviour, bit for bit."""


class FcfsPolicy(NativePolicy):
    name = "fcfs"
    params_model: ClassVar[type[PolicyParams]] = FcfsParams
