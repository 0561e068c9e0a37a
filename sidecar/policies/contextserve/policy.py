"""``contextserve``: Continuum's scheduling with a three-way retention decision.

FAST tools (rule table) pin for a fixed TTL, SLOW tools (rule table) release at once,
UNCERTAIN tools pin for a Bayesian quantile of their duration once they have enough
samples, else fall back to Continuum's TTL. Admission, preemption, stealing and expiry
are Continuum's (as in the reference, which reuses ContinuumRequestQueue).

See README.md beside this file for the rules and the parameters.
"""

from __future__ import annotations

import enum
from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from sidecar.api.toolcalls import command_key
from sidecar.estimators.nig import NigPosterior, NigPrior
from sidecar.framework.types import FinishInput
from sidecar.policies.base import PolicyParams
from sidecar.policies.continuum.policy import ContinuumParams, ContinuumPolicy

DEFAULT_FAST_COMMANDS = (
    "ls",
    "cat",
    "pwd",
    "echo",
    "head",
    "tail",
    "wc",
    "which",
    "stat",
    "tree",
    "grep",
    "rg",
    "find",
    "sed",
    "diff",
    "git status",
    "git diff",
    "git log",
    "git show",
    "git branch",
)
DEFAULT_SLOW_PREFIXES = (
    "pytest",
    "tox",
    "make",
    "cmake",
    "pip install",
    "uv sync",
    "conda install",
    "apt-get install",
    "apt install",
    "npm install",
    "npm test",
    "yarn install",
    "cargo build",
    "cargo test",
    "go build",
    "go test",
    "mvn",
    "gradle",
    "docker build",
    "docker compose",
)


class ToolSpeed(enum.Enum):
    FAST = "fast"
    SLOW = "slow"
    UNCERTAIN = "uncertain"


class ContextServeParams(ContinuumParams):
    # Command keys (``sidecar.api.toolcalls.command_key``) pinned for fast_ttl_s.
    fast_commands: tuple[str, ...] = DEFAULT_FAST_COMMANDS
    # Command-key prefixes, on word boundaries, released at once ("pip install"
    # matches "pip install" only; "make" matches "make").
    slow_prefixes: tuple[str, ...] = DEFAULT_SLOW_PREFIXES
    fast_ttl_s: float = Field(default=3.0, ge=0.0)
    # UNCERTAIN: pin for this quantile of the posterior predictive duration...
    uncertain_quantile: float = Field(default=0.9, gt=0.0, lt=1.0)
    # ...once the tool has this many samples; fewer: Continuum's TTL.
    bayes_min_samples: int = Field(default=3, ge=1)
    # Cold-start prior on ln(duration_s) (see sidecar/estimators/nig.py).
    prior_mean_log_s: float = 0.0
    prior_kappa: float = Field(default=1.0, gt=0.0)
    prior_alpha: float = Field(default=2.0, gt=0.0)
    prior_beta: float = Field(default=1.0, gt=0.0)

    @field_validator("fast_commands", "slow_prefixes")
    @classmethod
    def _normalise(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        # Entries are keyed the way tool calls are, so "python -m pytest" in a table
        # matches the parsed key "pytest".
        normalised = []
        for entry in entries:
            key = command_key(entry)
            if key is None:
                raise ValueError(f"{entry!r} is not a command")
            normalised.append(key)
        return tuple(dict.fromkeys(normalised))

    @model_validator(mode="after")
    def _tables_disjoint(self) -> ContextServeParams:
        both = sorted(
            c for c in self.fast_commands if any(_has_prefix(c, p) for p in self.slow_prefixes)
        )
        if both:
            raise ValueError(f"commands both fast and slow: {', '.join(both)}")
        return self


def _has_prefix(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + " ")


class ContextServePolicy(ContinuumPolicy):
    name = "contextserve"
    params_model: ClassVar[type[PolicyParams]] = ContextServeParams
    params: ContextServeParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._fast = frozenset(self.params.fast_commands)
        self._slow = self.params.slow_prefixes
        self._prior = NigPrior(
            mean_log_s=self.params.prior_mean_log_s,
            kappa=self.params.prior_kappa,
            alpha=self.params.prior_alpha,
            beta=self.params.prior_beta,
        )

    def classify(self, tool: str | None) -> ToolSpeed:
        """FAST or SLOW by the rule tables, else UNCERTAIN. The tool is matched as
        given and as its command key (a client may name ``python -m pytest -x``)."""
        if tool is None:
            return ToolSpeed.UNCERTAIN
        key = command_key(tool)
        for candidate in (tool, key) if key is not None and key != tool else (tool,):
            if candidate in self._fast:
                return ToolSpeed.FAST
            if any(_has_prefix(candidate, prefix) for prefix in self._slow):
                return ToolSpeed.SLOW
        return ToolSpeed.UNCERTAIN

    def pin_ttl_s(self, finished: FinishInput) -> tuple[float | None, str]:
        params = self.params
        if finished.tool is None:
            return super().pin_ttl_s(finished)
        speed = self.classify(finished.tool)
        if speed is ToolSpeed.FAST:
            return params.fast_ttl_s, (
                f"contextserve FAST: {finished.tool!r} in the fast table: "
                f"pin {params.fast_ttl_s:g} s"
            )
        if speed is ToolSpeed.SLOW:
            return None, f"contextserve SLOW: {finished.tool!r} matches a slow prefix: release"
        times = finished.tool_times
        if times is None or times.count < params.bayes_min_samples:
            ttl_s, reason = super().pin_ttl_s(finished)
            return ttl_s, f"contextserve UNCERTAIN, too few samples: {reason}"
        posterior = NigPosterior.from_distribution(self._prior, times)
        ttl_s = posterior.predictive_quantile_s(params.uncertain_quantile)
        if ttl_s > params.max_ttl_s:
            return None, (
                f"contextserve UNCERTAIN: q{params.uncertain_quantile:g} of {finished.tool!r} "
                f"{ttl_s:.3g} s > max_ttl_s {params.max_ttl_s:g} s: release"
            )
        return ttl_s, (
            f"contextserve UNCERTAIN: q{params.uncertain_quantile:g} of {finished.tool!r} "
            f"from {times.count} samples: pin {ttl_s:.3g} s"
        )
