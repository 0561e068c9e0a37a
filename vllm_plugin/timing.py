"""Step timing (the work the daemon learns the step cost from) and the answer lag.

Engine thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from sidecar.api.v1 import engine_session_pb2 as pb

# Buckets of the decision-lag histogram: 0-6 steps, and 7 or more.
LAG_BUCKETS = 8
# Steps scheduled and never updated (an engine error) are dropped past this many.
MAX_STEPS_IN_FLIGHT = 4


class StepTiming:
    """Steps scheduled and not yet updated: (engine clock at the end of ``schedule()``,
    prefill tokens, decode requests), oldest first (async scheduling schedules the next
    step before the last one is updated). Timed steps add up in ``work``, which the
    next report carries."""

    def __init__(self, clock_s: Callable[[], float]) -> None:
        self.clock_s = clock_s
        self.in_flight: deque[tuple[float, int, int]] = deque()
        self.work = pb.StepWork()

    def start(self, output: Any, now_s: float) -> None:
        """Remember what this step scheduled, to time it when it is updated. A
        request scheduled one token decodes; more, it computes its prompt (a chunk of
        it, or a re-computation). A step that scheduled nothing is not timed."""
        scheduled = getattr(output, "num_scheduled_tokens", None)
        total = int(getattr(output, "total_num_scheduled_tokens", 0) or 0)
        if not scheduled or total <= 0:
            return
        decode = list(scheduled.values()).count(1)  # C speed: ~150 requests a step
        if len(self.in_flight) >= MAX_STEPS_IN_FLIGHT:
            self.in_flight.popleft()
        self.in_flight.append((now_s, total - decode, decode))

    def finish(self) -> None:
        """The oldest step in flight is updated: add it to the work to report."""
        started_s, prefill, decode = self.in_flight.popleft()
        work = self.work
        work.steps += 1
        work.busy_s += max(self.clock_s() - started_s, 0.0)
        work.prefill_tokens += prefill
        work.decode_seqs += decode

    def take(self, report: pb.StepReport) -> None:
        """Move the work timed since the last report into ``report``."""
        if self.work.steps:
            report.work.CopyFrom(self.work)
            self.work.Clear()

    def drop(self) -> None:
        """Nobody to report to: forget the work timed so far."""
        self.work.Clear()


class AnswerLag:
    """Steps between sending a report and applying its answer. ``counts[k]`` counts
    answers applied k steps late (last bucket: that many or more); it is the
    counters' field, so every report carries it to the daemon."""

    def __init__(self, counters: pb.EngineCounters) -> None:
        self.step_index = 0
        counters.answers_by_lag_steps.extend([0] * LAG_BUCKETS)
        self.counts = counters.answers_by_lag_steps
        # Report seq -> the step it was sent at, until its answer is applied.
        self.sent_at_step: dict[int, int] = {}

    def overdue(self) -> bool:
        """An answer is later than the normal one-step lag (one in flight since the
        last step is expected)."""
        step = self.step_index - 1
        return any(sent < step for sent in self.sent_at_step.values())

    def sent(self, report: pb.StepReport) -> None:
        if report.snapshot:
            self.sent_at_step.clear()  # answers to an older session never come
        self.sent_at_step[report.seq] = self.step_index

    def answered(self, seq: int) -> None:
        sent_at_step = self.sent_at_step.pop(seq, None)
        if sent_at_step is not None:
            lag = min(self.step_index - sent_at_step, len(self.counts) - 1)
            self.counts[lag] += 1

    def awaits(self, seq: int) -> bool:
        """Whether the answer to report ``seq`` has not been applied yet."""
        return seq in self.sent_at_step
