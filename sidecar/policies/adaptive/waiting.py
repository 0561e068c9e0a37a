"""How the engine keeps a finished turn's blocks while the daemon decides on its pin.

The engine reports a finished turn a step after it finished and hears the daemon's
word some steps later (the answer's lag: one step on a fast engine, seven or more for
a fifth of the answers on a saturated CPU engine). Until then the blocks are either
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
"""

from __future__ import annotations

from collections import deque

# Recent non-last finishes the share is read over: enough to average over a burst of
# jobs, few enough to follow a change of load within a few seconds of finishes.
WINDOW_FINISHES = 32
# Hold while at least this share of them was pinned: the more likely answer decides.
HOLD_AT_PIN_SHARE = 0.5


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
        decides. With no finish decided yet: hold, as the policy did before."""
        share = self.share
        return share is not None and share < HOLD_AT_PIN_SHARE
