"""How late an engine has lately applied the daemon's answers.

The plugin counts the answers it applied by steps after their report
(``EngineCounters.answers_by_lag_steps``, cumulative over its life; 1 is the design's
lag, a report at a step's end answered at the next ``schedule()``). On a GPU, or
wherever the daemon has a CPU to itself, nearly every answer lands within 1-2 steps.
Where the engine keeps every CPU busy the daemon waits for one now and then, and a
large share of the answers land 3 or more steps late (the engine benchmark reports the
lags of each run). Whatever the engine keeps waiting on an answer meanwhile is kept
that much longer: a policy reads the recent share of late answers to choose a wait that
costs less (``StepView.late_answer_share``, read by ``Policy.caches_provisional_pins``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

# An answer applied this many steps after its report, or more, is late: one step is
# the design's lag, two is a round trip that missed one step.
LATE_ANSWER_STEPS = 3
# Recent answers the share is read over: long enough to span several of a busy
# engine's CPU stalls (seconds of its reports), so the share reads the node, not the
# last stall; a window of a few dozen answers falls below a tenth between stalls and
# flips a policy's choice back and forth. Why 256: see docs/decisions/.
WINDOW_ANSWERS = 256


class RecentAnswerLags:
    """The lags of an engine's last ``window`` answers, from its cumulative counts."""

    def __init__(self, window: int = WINDOW_ANSWERS) -> None:
        self._window = window
        self._lags: deque[int] = deque()
        # The window's answers by lag, kept with it: the share is read every decision.
        self._by_lag: Counter[int] = Counter()
        self._counted: tuple[int, ...] = ()

    def update(self, answers_by_lag_steps: Sequence[int]) -> None:
        """Take the engine's cumulative counts from a report. Counts that went back
        (a restarted plugin) start over from them."""
        counts = tuple(answers_by_lag_steps)
        if not counts:
            return
        if len(counts) != len(self._counted) or any(
                now < before for now, before in zip(counts, self._counted, strict=True)):
            self._counted = counts
            return
        # Within one report the order of the new answers is not known; a report adds
        # one or two.
        for lag, (now, before) in enumerate(zip(counts, self._counted, strict=True)):
            for _ in range(min(now - before, self._window)):
                if len(self._lags) == self._window:
                    self._by_lag[self._lags.popleft()] -= 1
                self._lags.append(lag)
                self._by_lag[lag] += 1
        self._counted = counts

    def late_share(self, late_steps: int = LATE_ANSWER_STEPS) -> float | None:
        """The share of the recent answers applied ``late_steps`` or more steps after
        their report; None before any answer was counted."""
        if not self._lags:
            return None
        late = sum(answers for lag, answers in self._by_lag.items() if lag >= late_steps)
        return late / len(self._lags)
