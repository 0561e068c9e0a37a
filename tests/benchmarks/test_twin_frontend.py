"""The twin's API server: when a request sent to the engine reaches its scheduler."""

from __future__ import annotations

import pytest

from benchmarks.twin.frontend import Arrivals, FrontEnd


def _reach(arrivals: Arrivals) -> list[tuple[float, int, int]]:
    return [(round(at_s, 9), job, turn) for at_s, job, turn in arrivals.take_ready()]


def test_without_a_delay_a_request_reaches_the_scheduler_when_sent_in_send_order() -> None:
    arrivals = Arrivals(FrontEnd())
    arrivals.send(0.5, job_index=1, turn_index=0)
    arrivals.send(0.2, job_index=0, turn_index=0)
    arrivals.send(0.5, job_index=2, turn_index=3)
    assert arrivals.next_reach_s() == pytest.approx(0.2)
    arrivals.advance(0.5, busy=True)  # the engine's pace does not matter without work
    assert _reach(arrivals) == [(0.2, 0, 0), (0.5, 1, 0), (0.5, 2, 3)]
    assert not arrivals


def test_an_idle_engine_leaves_the_api_server_its_full_pace() -> None:
    arrivals = Arrivals(FrontEnd(delay_s=0.02, busy_rate=0.25))
    arrivals.send(1.0, job_index=0, turn_index=0)
    assert arrivals.next_reach_s() == pytest.approx(1.02)
    arrivals.advance(1.01, busy=False)
    assert _reach(arrivals) == []  # on its way
    arrivals.advance(arrivals.next_reach_s(), busy=False)
    assert _reach(arrivals) == [(1.02, 0, 0)]
    assert arrivals.front_s_total == pytest.approx(0.02)


def test_a_request_sent_while_the_engine_computes_reaches_it_mostly_after() -> None:
    # 20 ms of work at a quarter pace during a 40 ms step: 10 ms done, 10 ms left
    # once the engine goes idle (as on the CPU engine, where a request sent while
    # it computes reaches it a median 10 ms after it goes idle).
    arrivals = Arrivals(FrontEnd(delay_s=0.02, busy_rate=0.25))
    arrivals.send(0.0, job_index=0, turn_index=0)
    arrivals.advance(0.04, busy=True)
    assert _reach(arrivals) == []
    assert arrivals.next_reach_s() == pytest.approx(0.05)
    arrivals.advance(0.05, busy=False)
    assert _reach(arrivals) == [(0.05, 0, 0)]


def test_a_request_done_within_a_step_reached_the_scheduler_when_its_work_ran_out() -> None:
    arrivals = Arrivals(FrontEnd(delay_s=0.01, busy_rate=0.5))
    arrivals.send(0.1, job_index=4, turn_index=2)   # sent mid-step
    arrivals.send(0.0, job_index=3, turn_index=1)
    arrivals.advance(0.2, busy=True)  # both need 20 ms of the step at half pace
    assert _reach(arrivals) == [(0.02, 3, 1), (0.12, 4, 2)]


def test_a_bad_front_end_is_named() -> None:
    with pytest.raises(ValueError, match=r"busy_rate 0\.0 must be in"):
        FrontEnd(delay_s=0.01, busy_rate=0.0)
    with pytest.raises(ValueError, match="delay_s -1 must be >= 0"):
        FrontEnd(delay_s=-1)
    with pytest.raises(ValueError, match="no request on its way"):
        Arrivals(FrontEnd()).next_reach_s()
