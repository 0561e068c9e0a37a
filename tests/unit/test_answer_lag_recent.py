"""How late an engine applied the daemon's answers lately, read from the cumulative
counts its reports carry (sidecar/telemetry/answer_lag.py)."""

from __future__ import annotations

import pytest

from sidecar.telemetry.answer_lag import RecentAnswerLags


def test_the_share_is_of_the_recent_answers_landed_3_or_more_steps_late() -> None:
    lags = RecentAnswerLags(window=10)
    assert lags.late_share() is None, "no answer counted yet"
    lags.update([0, 0, 0, 0])  # the first counts are the baseline
    assert lags.late_share() is None
    lags.update([0, 6, 2, 0])  # 6 answers 1 step late, 2 answers 2 steps late
    assert lags.late_share() == 0.0
    lags.update([0, 6, 2, 2])  # 2 answers 3 steps late (or more: the last bucket)
    assert lags.late_share() == pytest.approx(0.2)
    assert lags.late_share(late_steps=2) == pytest.approx(0.4)


def test_old_answers_leave_the_window() -> None:
    lags = RecentAnswerLags(window=10)
    lags.update([0, 0, 0, 0])
    lags.update([0, 0, 0, 30])  # a stall: 30 answers late
    assert lags.late_share() == 1.0
    lags.update([0, 8, 0, 30])
    assert lags.late_share() == pytest.approx(0.2)
    lags.update([0, 20, 0, 30])
    assert lags.late_share() == 0.0, "the stall is over"


def test_counts_that_go_back_start_over() -> None:
    # A restarted plugin counts from 0 again: its counts are the new baseline.
    lags = RecentAnswerLags(window=10)
    lags.update([0, 5, 0, 5])
    lags.update([0, 5, 0, 10])
    assert lags.late_share() == 1.0
    lags.update([0, 1, 0, 0])
    assert lags.late_share() == 1.0, "nothing new counted from a restart"
    lags.update([0, 3, 0, 0])
    assert lags.late_share() == pytest.approx(5 / 7)
    lags.update([])  # a report without the histogram changes nothing
    assert lags.late_share() == pytest.approx(5 / 7)
