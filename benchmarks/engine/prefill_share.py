"""How saturated by prefill the engine was during a round, as the daemon saw it.

The daemon exports ``kvtether_engine_prefill_time_ratio``: the prompt tokens a second
the engine's reports carried over the last ~10 s of its clock, times what one token
costs on it as learned (0-1). The adaptive policy reads the same figure: at or above
its ``saturated_prefill_share`` (0.4 by default) it credits every waiting request its
job's age, below it only the requests that fit in the free blocks
(docs/decisions/019). Sampled every second during a round, the gauge says how much of
the round counted as saturated, and so for how long adaptive gave that credit, which
the job times alone do not say.

The gauge is set per report and holds its last value while the engine is idle; a
restarted daemon has none until it has learned a token's cost, so the first seconds
of a round may go unsampled.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from benchmarks.common.engine_runs import summarize_prefill_share

PREFILL_SHARE_GAUGE = "kvtether_engine_prefill_time_ratio"


class PrefillShareSampler(threading.Thread):
    """Reads the gauge every ``period_s`` while a policy runs. ``read`` returns the
    daemon's metrics by sample name (None: not exported yet); a failed read (the
    daemon's metrics port busy or restarting) skips that sample."""

    def __init__(self, read: Callable[[], dict[str, Any]], period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.read = read
        self.period_s = period_s
        self.samples: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            with contextlib.suppress(OSError):
                value = self.read().get(PREFILL_SHARE_GAUGE)
                if value is not None:
                    self.samples.append(float(value))

    def finish(self, threshold: float) -> dict[str, float] | None:
        """Stop sampling and summarize the round."""
        self.stop.set()
        self.join()
        return summarize_prefill_share(self.samples, threshold)
