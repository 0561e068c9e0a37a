"""An engine's step cost, learned from the work its step reports carry.

A policy that weighs keeping a context against re-computing it needs what a token of
prefill costs on *this* engine. The figure varies tenfold with the hardware and the
model (of the order of 1e-4 s a token for an 8B model on one GPU, 2e-5 to 2e-4 s for
vLLM's CPU build with a tiny model), and a policy given the wrong one values every
context wrongly.

Each report carries the steps the engine ran since the previous one, how long they
took (end of ``schedule()`` to end of ``update_from_output()``), the prompt tokens they
computed and the requests they decoded (``StepWork``). The cost of a step is linear in
them, as in the twin's step-time model (benchmarks/twin/steptime.py)::

    busy_s = step_s * steps + prefill_s_per_token * prefill_tokens
             + decode_s_per_seq * decode_seqs

fitted by least squares over the reports, coefficients kept non-negative, a report's
weight 1 / its steps (a sum of n steps varies n times as much as one step), the past
forgotten exponentially over ``window_s`` seconds of engine work so a model swapped
under the same engine id is learned again. The attention over the context each step
reads is not a regressor: it grows with the decoding requests and is absorbed by
``decode_s_per_seq``.

The estimate is given only once it is known to within ``max_relative_error`` (the
standard error of the prefill coefficient against its value): until then the policy
uses its configured default.

The sums are updated at every report; the fit itself (``_fit``) is redone on the
decision path once per ``REFIT_EVERY_REPORTS`` reports (``current``), and on demand
for Inspect (``estimate``).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass

from sidecar.framework.types import EngineCost

_REGRESSORS = 3  # steps, prefill tokens, decode requests
# On the decision path the fit is redone once per this many reports with work, not at
# every one: a fit is seven small solves, about a fifth of a decision's time in Python
# (see docs/decisions/).
REFIT_EVERY_REPORTS = 32


@dataclass(frozen=True, slots=True)
class StepWork:
    steps: int
    busy_s: float
    prefill_tokens: int
    decode_seqs: int


class StepCostEstimator:
    """Weighted, forgetting least squares of one engine's step cost."""

    def __init__(self, window_s: float = 120.0, min_reports: int = 20,
                 min_prefill_tokens: int = 10_000, max_relative_error: float = 0.2) -> None:
        if not window_s > 0.0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.min_reports = min_reports
        self.min_prefill_tokens = min_prefill_tokens
        self.max_relative_error = max_relative_error
        # Decayed sums: X'WX, X'Wy, y'Wy, reports, steps, prefill tokens.
        self._xx = [[0.0] * _REGRESSORS for _ in range(_REGRESSORS)]
        self._xy = [0.0] * _REGRESSORS
        self._yy = 0.0
        self._reports = 0.0
        self._steps = 0.0
        self._prefill_tokens = 0.0
        self._estimate: EngineCost | None = None
        self._added_since_fit = 0
        # The estimate last exported to the metrics, and the prefill figure last
        # logged (the registry's, kept here so that they go with the engine).
        self.exported: EngineCost | None = None
        self.logged_prefill_s: float | None = None

    def add(self, work: StepWork) -> None:
        """Fold in one report's work (ignored if it ran no step or is not finite)."""
        if work.steps <= 0 or not math.isfinite(work.busy_s) or work.busy_s < 0.0:
            return
        kept = math.exp(-work.busy_s / self.window_s)
        x = (float(work.steps), float(work.prefill_tokens), float(work.decode_seqs))
        weight = 1.0 / work.steps
        for i in range(_REGRESSORS):
            self._xy[i] = kept * self._xy[i] + weight * x[i] * work.busy_s
            row = self._xx[i]
            for j in range(_REGRESSORS):
                row[j] = kept * row[j] + weight * x[i] * x[j]
        self._yy = kept * self._yy + weight * work.busy_s * work.busy_s
        self._reports = kept * self._reports + 1.0
        self._steps = kept * self._steps + work.steps
        self._prefill_tokens = kept * self._prefill_tokens + work.prefill_tokens
        self._added_since_fit += 1

    def estimate(self) -> EngineCost | None:
        """The step cost from every report so far, or None while it is not known
        well enough."""
        if self._added_since_fit:
            self._estimate = self._fit()
            self._added_since_fit = 0
        return self._estimate

    def current(self) -> EngineCost | None:
        """The step cost for the decision path: fitted again once every
        ``REFIT_EVERY_REPORTS`` reports with work (the same object in between)."""
        if self._added_since_fit >= REFIT_EVERY_REPORTS:
            return self.estimate()
        return self._estimate

    def _fit(self) -> EngineCost | None:
        if self._reports < self.min_reports or self._prefill_tokens < self.min_prefill_tokens:
            return None
        # The regressors differ by orders of magnitude (steps, tokens): solve in units
        # where each has unit weighted norm.
        norm = [math.sqrt(self._xx[i][i]) or 1.0 for i in range(_REGRESSORS)]

        def scaled(free: tuple[int, ...]) -> list[list[float]]:
            return [[self._xx[i][j] / (norm[i] * norm[j]) for j in free] for i in free]

        best: tuple[float, list[float], tuple[int, ...]] | None = None
        # Non-negative least squares by trying every set of free coefficients: three
        # regressors make seven sets, each a tiny linear solve.
        for size in range(_REGRESSORS, 0, -1):
            for free in itertools.combinations(range(_REGRESSORS), size):
                theta = _solve(scaled(free), [self._xy[i] / norm[i] for i in free])
                if theta is None or min(theta) < 0.0:
                    continue
                full = [0.0] * _REGRESSORS
                for index, value in zip(free, theta, strict=True):
                    full[index] = value / norm[index]
                sse = self._sse(full)
                if best is None or sse < best[0]:
                    best = (sse, full, free)
        if best is None:
            return None
        sse, theta, free = best
        step_s, prefill_s, decode_s = theta
        if prefill_s <= 0.0 or 1 not in free:
            return None
        # Standard error of the prefill coefficient: sigma^2 (X'WX)^-1 on the free set.
        dof = self._reports - len(free)
        if dof <= 0.0:
            return None
        variance = max(sse, 0.0) / dof
        inverse = _inverse(scaled(free))
        if inverse is None:
            return None
        k = free.index(1)
        error = math.sqrt(max(variance * inverse[k][k], 0.0)) / norm[1]
        if error > self.max_relative_error * prefill_s:
            return None
        return EngineCost(prefill_s_per_token=prefill_s, decode_s_per_seq=decode_s,
                          step_s=step_s, steps=round(self._steps),
                          prefill_relative_error=error / prefill_s)

    def _sse(self, theta: list[float]) -> float:
        quadratic = sum(theta[i] * self._xx[i][j] * theta[j]
                        for i in range(_REGRESSORS) for j in range(_REGRESSORS))
        return self._yy - 2.0 * sum(t * r for t, r in zip(theta, self._xy, strict=True)) + quadratic


class PrefillRate:
    """Prompt tokens an engine computed a second, averaged over the last ``window_s``
    seconds of its clock (exponentially: a report's tokens weigh ``exp(-age /
    window_s)``).

    Times the engine's prefill cost, it is the share of the engine's time spent
    computing prompts: the adaptive policy reads it to tell an engine saturated by
    prefill from one with time to spare. The average is over the time since the first
    report while that is shorter than the window, so it is not biased low at the start.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        if not window_s > 0.0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._tokens = 0.0
        # The decayed seconds the tokens were counted over (window_s once long enough).
        self._counted_s = 0.0
        self._last_s: float | None = None

    def add(self, now_s: float, prefill_tokens: int) -> None:
        """Count the prompt tokens of the steps reported at ``now_s`` (since the
        previous report). A first report, or a clock that went back (the engine
        restarted), starts the count afresh."""
        if self._last_s is None or now_s < self._last_s:
            self._tokens = 0.0
            self._counted_s = 0.0
            self._last_s = now_s
            return
        elapsed_s = now_s - self._last_s
        kept = math.exp(-elapsed_s / self.window_s)
        # The tokens were computed over the elapsed seconds, not at their end: weighed
        # by the mean decay over them, a steady rate reads exactly, however sparse
        # the reports.
        spread = (1.0 - kept) * self.window_s / elapsed_s if elapsed_s > 0.0 else 1.0
        self._tokens = kept * self._tokens + spread * prefill_tokens
        self._counted_s = kept * self._counted_s + (1.0 - kept) * self.window_s
        self._last_s = now_s

    def per_s(self) -> float | None:
        """The average, or None before two reports some time apart."""
        if self._counted_s <= 0.0:
            return None
        return self._tokens / self._counted_s


class EngineStepCosts:
    """One estimator per engine id, for at most ``max_engines`` engines: engine ids
    come and go with pods, and the one that reported least recently is forgotten
    first (an engine that reports again is learned again)."""

    def __init__(self, max_engines: int = 4096) -> None:
        if max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {max_engines!r}")
        self.max_engines = max_engines
        self._by_engine: OrderedDict[str, StepCostEstimator] = OrderedDict()

    def add(self, engine_id: str, work: StepWork | None) -> StepCostEstimator:
        """Fold in one report's work (None: it carried none); answer the engine's
        estimator (``current()`` for the decision path)."""
        estimator = self._by_engine.get(engine_id)
        if estimator is None:
            estimator = self._by_engine[engine_id] = StepCostEstimator()
            while len(self._by_engine) > self.max_engines:
                self._by_engine.popitem(last=False)
        else:
            self._by_engine.move_to_end(engine_id)
        if work is not None:
            estimator.add(work)
        return estimator

    def forget(self, engine_id: str) -> None:
        self._by_engine.pop(engine_id, None)

    def estimates(self) -> dict[str, EngineCost]:
        """Each engine's step cost, where it is known well enough."""
        found = {}
        for engine_id, estimator in self._by_engine.items():
            cost = estimator.estimate()
            if cost is not None:
                found[engine_id] = cost
        return found


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        scale = max(abs(v) for v in m[pivot][:n]) or 1.0
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _inverse(a: list[list[float]]) -> list[list[float]] | None:
    n = len(a)
    columns = []
    for j in range(n):
        column = _solve(a, [1.0 if i == j else 0.0 for i in range(n)])
        if column is None:
            return None
        columns.append(column)
    return [[columns[j][i] for j in range(n)] for i in range(n)]
