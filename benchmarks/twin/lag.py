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

A CPU engine reports on only a quarter to a third of its steps (a change, or the pin
heartbeat), so a stall of S steps holds back that share of S reports and leaves S - 2
steps without a fresh answer (the plugin's ``fallback_steps``). Where the run recorded
its steps, :func:`fit` replays reports on the run's share of them and weighs the
fallback share it lands against the run's too.

The answers 0 steps late are the plugin's idle waits: going idle, the engine waits up
to its deadline for the answer to its last report, and gets it (99% of the waits on
the CPU engine), everything sent before with it. :func:`replay` puts those waits on
the run's share of the steps, where they end any stall in progress, and :func:`fit`
draws only the other answers, none of which lands before the next step.
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


@dataclass(frozen=True, slots=True)
class Landing:
    """How answers landed: their shares by steps late (index k, k steps; the last
    bucket, that many or more), and the share of the steps at which an answer was
    overdue (sent 2 or more steps before and not yet applied: the plugin's
    ``fallback_steps``, the steps scheduled without a fresh answer)."""

    shares: list[float]
    fallback_share: float


def replay(by_lag_steps: Sequence[float], tail_mean_steps: float, steps: int = 10_000,
           seed: int = 0, report_share: float = 1.0, wait_share: float = 0.0) -> Landing:
    """How answers land when each report draws its lag from ``by_lag_steps`` and the
    answers keep their order, reports going out on a random ``report_share`` of the
    steps (a CPU engine reports on about a third of its steps: only a change, or the
    pin heartbeat, is worth a message). The sparser the reports, the fewer a stall of
    S steps holds back, and the more of the S steps run on a stale answer.

    On a random ``wait_share`` of the steps the engine goes idle and waits for the
    answer to its report (the plugin's idle waits; on the CPU engine 99% come within
    the deadline): that report's answer lands 0 steps late and everything sent before
    it with it, so an idle engine ends any stall in progress."""
    if not 0.0 < report_share <= 1.0:
        raise ValueError(f"report share {report_share}: must be in (0, 1]")
    if not 0.0 <= wait_share < 1.0 or report_share + wait_share > 1.0:
        raise ValueError(f"wait share {wait_share}: must be in [0, 1) and, with the "
                         f"report share {report_share}, at most 1")
    draw = DrawnLag(by_lag_steps, tail_mean_steps, seed)
    reporting = random.Random(seed + 1)
    # What each step sends: None, a report, or a report it waits for (idle).
    kinds: list[str | None] = []
    for _step in range(steps):
        if wait_share == 0.0 and report_share == 1.0:
            kinds.append("report")
            continue
        u = reporting.random()
        kinds.append("wait" if u < wait_share
                     else "report" if u < wait_share + report_share else None)
    # The first idle wait at or after each step (none: past any lag drawn).
    next_wait: list[float] = [math.inf] * (steps + 1)
    for step in range(steps - 1, -1, -1):
        next_wait[step] = step if kinds[step] == "wait" else next_wait[step + 1]
    last = len(by_lag_steps) - 1
    counts = [0] * (last + 1)
    due = 0
    # The plugin counts a step as fallback while an answer sent 2+ steps before is not
    # applied: a report sent at step s and applied at step r covers steps s+2 .. r-1.
    # Answers land in order, so those spans are counted once each as they come.
    overdue_through = -1
    fallback = 0
    for step, kind in enumerate(kinds):
        if kind is None:
            continue
        # A waited report lands now; another no later than the next wait.
        due = (step if kind == "wait"
               else int(min(max(due, step + draw()), next_wait[step + 1])))
        counts[min(due - step, last)] += 1
        start = max(step + 2, overdue_through + 1)
        end = min(due - 1, steps - 1)  # the steps replayed, not past them
        if end >= start:
            fallback += end - start + 1
            overdue_through = end
    reports = sum(counts)
    return Landing([count / reports if reports else 0.0 for count in counts],
                   fallback / steps)


@dataclass(frozen=True, slots=True)
class FittedLag:
    """Lags to draw (``draw_shares``, tail ``tail_mean_steps``) so that, kept in order
    with reports on ``report_share`` of the steps and idle waits on ``wait_share``,
    answers land by ``landed_shares``, within ``error`` (total variation) of the
    recorded shares, and leave an answer overdue on ``fallback_share`` of the steps."""

    draw_shares: list[float]
    tail_mean_steps: float
    landed_shares: list[float]
    error: float
    fallback_share: float = 0.0
    report_share: float = 1.0
    wait_share: float = 0.0


def fit(recorded: Sequence[float], tail_means_steps: Sequence[float] = TAIL_MEANS_STEPS,
        iterations: int = 20, steps: int = 10_000, seed: int = 0,
        report_share: float = 1.0, fallback_share: float | None = None,
        wait_share: float = 0.0) -> FittedLag:
    """The lags to draw so that answers kept in order, reports on ``report_share`` of
    the steps, land as ``recorded`` (answers by steps late) did: for each tail mean,
    the shares are rescaled by recorded over landed until they settle (the same draws
    every time, so it converges smoothly). The tail mean whose replay lands closest
    wins; with the run's ``fallback_share`` (its steps without a fresh answer) the
    distance counts how far the replay's is from it too: the lag shares alone do not
    say how long the stalls were in steps, the steps they left stale do. With the
    run's ``wait_share`` (its idle waits over its steps) the answers 0 steps late are
    the waited ones, and the drawn lags none: a report not waited for is applied at
    the next step at the earliest."""
    _check_counts(recorded)
    if not 0.0 < report_share <= 1.0:
        raise ValueError(f"report share {report_share}: must be in (0, 1]")
    if fallback_share is not None and not 0.0 <= fallback_share <= 1.0:
        raise ValueError(f"fallback share {fallback_share}: must be in [0, 1]")
    total = sum(recorded)
    target = [count / total for count in recorded]
    # About as many answers at any share.
    replay_steps = round(steps / (report_share + wait_share))
    drawn_from = 1 if wait_share > 0 else 0  # lag 0: the waits', not drawn
    if sum(target[drawn_from:]) <= 0:
        raise ValueError(f"answers by lag {list(recorded)}: none 1 or more steps late to "
                         "draw from")
    best: FittedLag | None = None
    best_distance = math.inf
    for tail in tail_means_steps:
        shares = [share if lag >= drawn_from else 0.0 for lag, share in enumerate(target)]
        for _ in range(iterations):
            landed = replay(shares, tail, replay_steps, seed, report_share, wait_share).shares
            # Where nothing landed yet, a share still wanted is nudged up.
            shares = [share * (want / got if got > 0 else 2.0)
                      if want > 0 and lag >= drawn_from else 0.0
                      for lag, (share, want, got)
                      in enumerate(zip(shares, target, landed, strict=True))]
            norm = sum(shares)
            shares = [share / norm for share in shares]
        landing = replay(shares, tail, replay_steps, seed, report_share, wait_share)
        error = sum(abs(got - want)
                    for got, want in zip(landing.shares, target, strict=True)) / 2
        distance = error + (0.0 if fallback_share is None
                            else abs(landing.fallback_share - fallback_share))
        if distance < best_distance:
            best_distance = distance
            best = FittedLag(shares, tail, landing.shares, error, landing.fallback_share,
                             report_share, wait_share)
    assert best is not None
    return best
