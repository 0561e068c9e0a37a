"""How late the daemon's answers land on a real engine, as the twin replays it.

A real CPU engine records its answers by steps late (``answers_by_lag_steps``: index
k, applied k steps after their report; the last bucket, 7 or more). Those answers
come down one stream in order: a daemon off its CPU for a while answers nothing, then
everything at once, so the report sent just before the stall lands many steps late
and those sent during it fewer. Drawing each answer's lag from the recorded shares
and keeping the order would count that twice (the recorded shares already hold the
queueing), so :func:`fit` finds the lags to draw: the shares that, kept in order,
land as the recorded ones did. How far past 7 steps the last bucket went is not
recorded, but the order tells: a stall of S steps puts S - 6 answers at 7 or more and
one at each of 3 to 6, so the tail mean is the one whose replay matches both.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

# Tail means (steps past the last bucket) :func:`fit` tries.
TAIL_MEANS_STEPS = (0.0, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0)


def _check_counts(by_lag_steps: Sequence[float]) -> None:
    if not by_lag_steps or sum(by_lag_steps) <= 0 or min(by_lag_steps) < 0:
        raise ValueError(f"answers by lag {list(by_lag_steps)}: need counts >= 0, "
                         "not all 0")


class DrawnLag:
    """Steps after its report an answer may be applied, drawn from shares by lag.

    ``by_lag_steps[k]`` weighs a lag of k steps (the last bucket: that many or more).
    A draw of the last bucket adds a geometric number of steps with mean
    ``tail_mean_steps`` (0: none)."""

    def __init__(self, by_lag_steps: Sequence[float], tail_mean_steps: float,
                 seed: int) -> None:
        _check_counts(by_lag_steps)
        if not tail_mean_steps >= 0:
            raise ValueError(f"tail mean {tail_mean_steps} steps: must be >= 0")
        self.weights = list(by_lag_steps)
        self.tail_mean_steps = tail_mean_steps
        self._random = random.Random(seed)
        self._lags = range(len(self.weights))
        self._cumulative = [sum(self.weights[:k + 1]) for k in self._lags]

    def __call__(self) -> int:
        lag = self._random.choices(self._lags, cum_weights=self._cumulative)[0]
        if lag == len(self.weights) - 1 and self.tail_mean_steps > 0:
            # Geometric on {0, 1, ...} with that mean: P(stop) = 1 / (1 + mean).
            stop = 1.0 / (1.0 + self.tail_mean_steps)
            lag += int(math.log(1.0 - self._random.random()) / math.log(1.0 - stop))
        return lag


def in_order(by_lag_steps: Sequence[float], tail_mean_steps: float, steps: int = 10_000,
             seed: int = 0) -> list[float]:
    """The shares by steps late with which answers land when each step's report draws
    its lag from ``by_lag_steps`` and the answers keep their order (one report a step)."""
    draw = DrawnLag(by_lag_steps, tail_mean_steps, seed)
    last = len(by_lag_steps) - 1
    counts = [0] * (last + 1)
    due = 0
    for step in range(steps):
        due = max(due, step + draw())
        counts[min(due - step, last)] += 1
    return [count / steps for count in counts]


@dataclass(frozen=True, slots=True)
class FittedLag:
    """Lags to draw (``draw_shares``, tail ``tail_mean_steps``) so that, kept in order,
    answers land by ``landed_shares``, within ``error`` (total variation) of the
    recorded shares."""

    draw_shares: list[float]
    tail_mean_steps: float
    landed_shares: list[float]
    error: float


def fit(recorded: Sequence[float], tail_means_steps: Sequence[float] = TAIL_MEANS_STEPS,
        iterations: int = 20, steps: int = 10_000, seed: int = 0) -> FittedLag:
    """The lags to draw so that answers kept in order land as ``recorded`` (answers by
    steps late) did: for each tail mean, the shares are rescaled by recorded over
    landed until they settle (the same draws every time, so it converges smoothly);
    the tail mean whose replay lands closest wins."""
    _check_counts(recorded)
    total = sum(recorded)
    target = [count / total for count in recorded]
    best: FittedLag | None = None
    for tail in tail_means_steps:
        shares = list(target)
        for _ in range(iterations):
            landed = in_order(shares, tail, steps, seed)
            # Where nothing landed yet, a share still wanted is nudged up.
            shares = [share * (want / got if got > 0 else 2.0) if want > 0 else 0.0
                      for share, want, got in zip(shares, target, landed, strict=True)]
            norm = sum(shares)
            shares = [share / norm for share in shares]
        landed = in_order(shares, tail, steps, seed)
        error = sum(abs(got - want) for got, want in zip(landed, target, strict=True)) / 2
        if best is None or error < best.error:
            best = FittedLag(shares, tail, landed, error)
    assert best is not None
    return best
