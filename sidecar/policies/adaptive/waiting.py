"""How the engine keeps a finished turn's blocks while the daemon decides on its pin.

The engine reports a finished turn a step after it finished and hears the daemon's
word some steps later (the answer's lag: one step on a fast engine, several on an
engine whose daemon waits for a CPU). Until then the blocks are either
held (a provisional pin: nothing else can take them) or cached at the top retention
priority (free; taken only after every other free block;
``vllm_plugin/provisional.py``).

Holding is the right wait for a turn the policy will pin: the pin starts at the
finish, as Continuum's does, and admissions cannot take the blocks in between. For a
turn the policy will not pin, holding keeps memory from everyone for the lag and gives
nothing. Which one a finish will get is not known when the engine must choose, so the
choice follows the policy's recent answers: while at least half of the recent non-last
finishes were pinned, hold; below that, cache. The window counts finishes, not
seconds, so that it reads the same at any load. The policy keeps one per engine: a
saturated engine and an idle one behind the same daemon answer differently.

Except while the answers run late: where a tenth or more of the engine's recent
answers landed 3 or more steps after their report (a daemon waiting for a CPU on a
saturated node), cache whatever the share. Held, every finished turn's blocks wait
out that lag, pinned or not. Cached, an admission may take them before a late pin
lands, which costs where memory is short and the answers land on time; there this
rule leaves the choice to the pin share.
"""

from __future__ import annotations

from collections import deque

# Recent non-last finishes the share is read over: enough to average over a burst of
# jobs, few enough to follow a change of load within a few seconds of finishes.
WINDOW_FINISHES = 32
# Hold while at least this share of them was pinned: the more likely answer decides.
HOLD_AT_PIN_SHARE = 0.5
# Cache, whatever the share, while at least this share of the engine's recent answers
# landed late (sidecar/telemetry/answer_lag.py: 3 or more steps after their report).
# Where the daemon has a CPU to itself the share is near 0.
CACHE_AT_LATE_ANSWER_SHARE = 0.1


def answers_run_late(late_answer_share: float | None) -> bool:
    """Whether the engine's recent answers land late enough that holding a finished
    turn's blocks for them costs more than caching them (None: none counted yet)."""
    return late_answer_share is not None and late_answer_share >= CACHE_AT_LATE_ANSWER_SHARE


class PinShare:
    """The share of the recent non-last finishes the policy pinned."""

    def __init__(self, window: int = WINDOW_FINISHES) -> None:
        self._pinned: deque[bool] = deque(maxlen=window)

    def record(self, pinned: bool) -> None:
        self._pinned.append(pinned)

    @property
    def share(self) -> float | None:
        """None until a finish was decided."""
        if not self._pinned:
            return None
        return sum(self._pinned) / len(self._pinned)

    def caches(self) -> bool:
        """Cache (True) or hold (False) the next finishes' blocks while the daemon
        decides. With no finish decided yet: hold."""
        share = self.share
        return share is not None and share < HOLD_AT_PIN_SHARE
