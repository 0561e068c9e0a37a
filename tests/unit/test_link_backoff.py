"""The plugin's reconnect waits are jittered: the engines of a restarted daemon, whose
streams all end at the same instant, come back spread over each backoff step rather
than together, and no wait is longer than the step (1 s at most).

Each link draws from its own random source; the tests pass seeded ones."""

from __future__ import annotations

import random

from vllm_plugin.link import DaemonLink

ENGINES = 64
# The backoff's steps (vllm_plugin/link.py): the longest wait before each attempt.
STEPS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 1.0, 1.0)


def links(count: int, first_seed: int = 0) -> list[DaemonLink]:
    return [DaemonLink("127.0.0.1:1", connect=False, rng=random.Random(first_seed + i))
            for i in range(count)]


def test_the_waits_of_many_links_are_spread_over_each_step() -> None:
    fleet = links(ENGINES)
    for attempt, step_s in enumerate(STEPS_S):
        waits_s = [link.reconnect_delay_s(attempt) for link in fleet]
        assert all(0.0 <= wait_s <= step_s for wait_s in waits_s), (attempt, max(waits_s))
        # No two engines wait alike, and together they cover the step: the first and
        # the last of 64 uniform draws fall within a tenth of its ends.
        assert len(set(waits_s)) == ENGINES, attempt
        assert min(waits_s) < 0.1 * step_s and max(waits_s) > 0.9 * step_s, (
            attempt, min(waits_s), max(waits_s))


def test_waits_never_exceed_the_longest_step() -> None:
    (link,) = links(1, first_seed=11)
    waits_s = [link.reconnect_delay_s(attempt) for attempt in range(1000)]
    assert max(waits_s) <= 1.0
    # Past the last step the draws still spread over [0, 1 s]: about half below 0.5 s.
    assert 0.4 < sum(wait_s < 0.5 for wait_s in waits_s[5:]) / len(waits_s[5:]) < 0.6


def test_a_seeded_source_gives_the_same_waits() -> None:
    first, second = links(1, first_seed=7) + links(1, first_seed=7)
    assert ([first.reconnect_delay_s(a) for a in range(8)]
            == [second.reconnect_delay_s(a) for a in range(8)])


def test_links_made_without_a_source_draw_different_waits() -> None:
    # The plugin's own links (no source given) seed theirs from the OS.
    fleet = [DaemonLink("127.0.0.1:1", connect=False) for _ in range(ENGINES)]
    assert len({link.reconnect_delay_s(4) for link in fleet}) == ENGINES
