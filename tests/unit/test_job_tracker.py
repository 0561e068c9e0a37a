"""JobTracker: job views, tool-time measurement, robustness, bounded memory."""

from __future__ import annotations

import pytest

from sidecar.jobs.history import JobEvent
from sidecar.jobs.tracker import JobTracker, effective_job_id
from tests.unit.builders import JobScript, job, replay


def measured(*jobs_: JobScript) -> list[tuple[str, str, float]]:
    return [(m.job_id, m.tool, round(m.duration_s, 6)) for m in replay(JobTracker(), *jobs_)]


@pytest.mark.parametrize(
    ("jobs_", "expected"),
    [
        pytest.param(
            [job("a").turn(arrive=0, depart=1, tool="ls").turn(arrive=1.5, depart=2)],
            [("a", "ls", 0.5)],
            id="next-arrival-minus-departure",
        ),
        pytest.param(
            [job("a").turn(arrive=0, depart=1).turn(arrive=1.5, depart=2)],
            [],
            id="no-tool-no-sample",
        ),
        pytest.param(
            [
                job("a")
                .turn(arrive=0, depart=1, tool="ls")
                .turn(arrive=2, depart=3)
                .turn(arrive=4, depart=5)
            ],
            [("a", "ls", 1.0)],
            id="measured-once",
        ),
        pytest.param(
            [
                job("a")
                .turn(arrive=0, depart=1, tool="ls")
                .turn(arrive=1.2, depart=2, tool="cat")
                .turn(arrive=2.7)
            ],
            [("a", "ls", 0.2), ("a", "cat", 0.7)],
            id="each-turn-its-tool",
        ),
        pytest.param(
            [
                job("a")
                .turn(arrive=0, depart=1, tool="ls")
                .turn(arrive=0.5, depart=2)
                .turn(arrive=3)
            ],
            [("a", "ls", 2.0)],
            id="a-turn-that-arrived-before-the-call-does-not-measure-it",
        ),
        pytest.param(
            [job("a").turn(arrive=0, depart=1, tool="ls", last=True).turn(arrive=9)],
            [],
            id="last-step-ends-the-job",
        ),
        pytest.param(
            [
                job("a").turn(arrive=0, depart=1, tool="ls").turn(arrive=3),
                job("b").turn(arrive=0.5, depart=2, tool="cat").turn(arrive=2.25),
            ],
            [("b", "cat", 0.25), ("a", "ls", 2.0)],
            id="jobs-are-independent",
        ),
        pytest.param(
            [
                job(None)
                .turn(arrive=0, depart=1, tool="ls", request_id="r1")
                .turn(arrive=2, depart=3, request_id="r2")
            ],
            [],
            id="no-job-id-each-request-its-own-job",
        ),
    ],
)
def test_tool_time_measurement(
    jobs_: list[JobScript], expected: list[tuple[str, str, float]]
) -> None:
    assert measured(*jobs_) == expected


def test_job_view_follows_the_job() -> None:
    tracker = JobTracker()
    tracker.on_arrival("a", "r1", 5.0)
    tracker.on_arrival("a", "r2", 6.0)
    view = tracker.view("a")
    assert view is not None
    assert (view.first_arrival_s, view.requests_in_flight, view.turns_finished) == (5.0, 2, 0)
    tracker.on_finish("a", "r2", 7.0, "ls")
    tracker.on_finish("a", "r1", 6.5, "cat")  # finishes out of order
    view = tracker.view("a")
    assert view is not None
    assert view.requests_in_flight == 0
    assert view.turns_finished == 2
    assert (view.last_departure_s, view.last_tool) == (7.0, "ls")  # latest departure wins
    assert tracker.views(["a", "unknown", "a"]).keys() == {"a"}


def test_events_are_idempotent() -> None:
    tracker = JobTracker()
    tracker.on_arrival("a", "r1", 0.0)
    tracker.on_arrival("a", "r1", 0.0)  # replayed snapshot
    tracker.on_finish("a", "r1", 1.0, "ls")
    tracker.on_finish("a", "r1", 1.0, "ls")  # repeated finish
    view = tracker.view("a")
    assert view is not None
    assert (view.turns_finished, view.requests_in_flight) == (1, 0)
    sample = tracker.on_arrival("a", "r2", 1.5)
    assert sample is not None and sample.duration_s == 0.5
    assert tracker.on_arrival("a", "r2", 1.5) is None  # measured once


def test_finish_without_a_seen_arrival_still_counts() -> None:
    tracker = JobTracker()  # e.g. the daemon restarted while r1 ran
    tracker.on_finish("a", "r1", 10.0, "ls")
    sample = tracker.on_arrival("a", "r2", 10.4)
    assert sample is not None and sample.tool == "ls"
    view = tracker.view("a")
    assert view is not None and view.first_arrival_s == 10.0


def test_abort_leaves_no_request_in_flight_and_no_turn() -> None:
    tracker = JobTracker()
    tracker.on_arrival("a", "r1", 0.0)
    tracker.on_abort("a", "r1")
    tracker.on_abort("a", "r1")
    tracker.on_abort("b", "never-seen")
    view = tracker.view("a")
    assert view is not None
    assert (view.requests_in_flight, view.turns_finished) == (0, 0)


def test_effective_job_id_convention() -> None:
    assert effective_job_id("job", "req") == "job"
    assert effective_job_id(None, "req") == "req"
    assert effective_job_id("", "req") == "req"


def test_memory_is_bounded_by_evicting_idle_jobs_first() -> None:
    tracker = JobTracker(max_jobs=3)
    tracker.on_arrival("busy", "b1", 0.0)  # stays in flight
    for i in range(10):
        tracker.on_arrival(f"j{i}", f"r{i}", float(i))
        tracker.on_finish(f"j{i}", f"r{i}", float(i) + 0.5, None)
    assert len(tracker) == 3
    assert "busy" in tracker  # a job with a request in flight is never dropped
    assert "j9" in tracker and "j8" in tracker


def test_last_step_jobs_are_forgotten_first() -> None:
    tracker = JobTracker(max_jobs=2)
    tracker.on_arrival("done", "d1", 0.0)
    tracker.on_arrival("ongoing", "o1", 1.0)
    tracker.on_finish("ongoing", "o1", 2.0, "ls")
    tracker.on_finish("done", "d1", 3.0, None, is_last_step=True)  # most recent event
    tracker.on_arrival("new", "n1", 4.0)
    assert "done" not in tracker
    assert "ongoing" in tracker


def test_many_jobs_stay_within_the_bound() -> None:
    tracker = JobTracker(max_jobs=1000)
    for i in range(50_000):
        tracker.on_arrival(f"job-{i}", f"req-{i}", float(i))
        tracker.on_finish(f"job-{i}", f"req-{i}", float(i) + 0.1, "ls")
    assert len(tracker) == 1000


def test_only_busy_jobs_may_exceed_the_bound() -> None:
    tracker = JobTracker(max_jobs=2)
    for i in range(4):
        tracker.on_arrival(f"busy{i}", f"r{i}", float(i))
    assert len(tracker) == 4  # all in flight: none can be forgotten
    for i in range(4):
        view = tracker.view(f"busy{i}")
        assert view is not None and view.requests_in_flight == 1


def test_a_job_leaving_flight_is_forgotten_after_the_jobs_idle_before_it() -> None:
    tracker = JobTracker(max_jobs=3)
    tracker.on_arrival("long", "l1", 0.0)  # in flight while another job comes and goes
    tracker.on_arrival("a", "a1", 1.0)
    tracker.on_finish("a", "a1", 1.5, None)
    tracker.on_finish("long", "l1", 2.0, None)  # idle now, after a
    tracker.on_arrival("b", "b1", 3.0)
    tracker.on_arrival("c", "c1", 4.0)
    assert "a" not in tracker
    assert "long" in tracker and "b" in tracker and "c" in tracker


def test_max_jobs_is_validated() -> None:
    with pytest.raises(ValueError, match="max_jobs"):
        JobTracker(max_jobs=0)


# --- the persisted event format ------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        JobEvent("arrival", "a", "r1", 1.5, tool_time_s=0.25, prompt_tokens=812),
        JobEvent("finish", "a", "r1", 2.0, tool="git status", is_last_step=True,
                 output_tokens=0),
        JobEvent("abort", "job:{x}", "r2", 3.0),
    ],
)
def test_events_round_trip_as_json(event: JobEvent) -> None:
    assert JobEvent.from_json(event.to_json()) == event


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"v": 2, "kind": "arrival"}',
        b'{"v": 1, "kind": "teleport", "job_id": "a", "request_id": "r", "at_s": 1}',
        b'{"v": 1, "kind": "arrival", "job_id": "a", "request_id": "r", "at_s": "soon"}',
    ],
)
def test_unreadable_events_are_skipped(raw: bytes) -> None:
    assert JobEvent.from_json(raw) is None


def test_job_events_written_before_token_counts_still_read() -> None:
    # Events written before token counts were recorded still read, without them.
    old = b'{"v":1,"kind":"finish","job_id":"a","request_id":"r1","at_s":2.0,"tool":"ls"}'
    assert JobEvent.from_json(old) == JobEvent("finish", "a", "r1", 2.0, tool="ls")
    bad = old[:-1] + b',"output_tokens":-3}'
    assert JobEvent.from_json(bad) is None


def test_an_announced_tool_names_the_jobs_tool_and_its_measured_time() -> None:
    tracker = JobTracker()
    tracker.on_arrival("agent", "t1", 0.0)
    tracker.on_finish("agent", "t1", 1.0, None)  # the parser found no tool call
    assert tracker.on_tool_announced("agent", "pytest")
    view = tracker.view("agent")
    assert view is not None and view.last_tool == "pytest"
    measured = tracker.on_arrival("agent", "t2", 31.0)
    assert measured is not None and (measured.tool, measured.duration_s) == ("pytest", 30.0)
    # Nothing is kept for a job the tracker does not know, nor for one mid-turn.
    assert not tracker.on_tool_announced("unknown", "ls")
    assert not tracker.on_tool_announced("agent", "ls") and "unknown" not in tracker


def _ids(pairs: list[tuple[str, int]]) -> list[str]:
    return [job_id for job_id, _active in pairs]


def test_listjobs_order_is_activity_not_eviction() -> None:
    tracker = JobTracker()
    tracker.on_arrival("agent", "a1", 0.0)
    tracker.on_finish("agent", "a1", 1.0, None, is_last_step=True)  # forgotten first...
    tracker.on_arrival("other", "o1", 2.0)
    for index in range(5):
        tracker.on_arrival(None, f"anon{index}", 3.0 + index)
    # ...but listed by when it was last active, after the jobs active since.
    assert _ids(tracker.recent_jobs(10)) == ["other", "agent"]
    assert _ids(tracker.recent_jobs(3, include_anonymous=True)) == ["anon4", "anon3", "anon2"]
    tracker.on_arrival("agent", "a2", 9.0)
    assert _ids(tracker.recent_jobs(1)) == ["agent"]


def test_listjobs_pages_list_each_job_once_while_jobs_move() -> None:
    tracker = JobTracker()
    for index in range(6):
        tracker.on_arrival(f"j{index}", f"r{index}", float(index))
    first = tracker.recent_jobs(2)
    assert _ids(first) == ["j5", "j4"]
    tracker.on_arrival("j1", "r1b", 7.0)  # active again: ahead of the pages already read
    second = tracker.recent_jobs(2, active_before=first[-1][1])
    third = tracker.recent_jobs(2, active_before=second[-1][1])
    assert _ids(second) + _ids(third) == ["j3", "j2", "j0"]


def test_listjobs_forgets_evicted_jobs_in_every_order() -> None:
    tracker = JobTracker(max_jobs=2)
    for index in range(4):
        tracker.on_arrival(f"j{index}", f"r{index}", float(index))
        tracker.on_finish(f"j{index}", f"r{index}", index + 0.5, None)
        tracker.on_arrival(None, f"anon{index}", index + 0.6)
        tracker.on_finish(None, f"anon{index}", index + 0.7, None)
    assert len(tracker) == 2
    assert _ids(tracker.recent_jobs(10, include_anonymous=True)) == ["anon3", "j3"]
