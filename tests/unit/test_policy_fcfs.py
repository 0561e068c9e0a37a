"""fcfs = vLLM's native behaviour: the baseline every policy inherits."""

from __future__ import annotations

import pytest

from sidecar.framework.protocols import Policy
from sidecar.framework.types import RetainAction
from sidecar.policies.registry import build_policy
from tests.unit.builders import step


@pytest.fixture
def fcfs() -> Policy:
    return build_policy("fcfs", {})


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [
        pytest.param([("b", 2.0), ("a", 1.0), ("c", 3.0)], ["a", "b", "c"], id="by-arrival"),
        pytest.param([("z", 1.0), ("y", 1.0)], ["y", "z"], id="ties-by-request-id"),
        pytest.param([], [], id="empty"),
    ],
)
def test_admits_earliest_arrival_first(
    fcfs: Policy, waiting: list[tuple[str, float]], expected: list[str]
) -> None:
    s = step()
    for request_id, arrive in waiting:
        s.waiting(request_id, arrive=arrive)
    assert list(fcfs.order_waiting(s.build()).request_ids) == expected


def test_ignores_jobs_when_admitting(fcfs: Policy) -> None:
    # A late request of an early job does not jump the queue under fcfs.
    s = (
        step()
        .waiting("late-of-old-job", job="old", arrive=9.0)
        .waiting("new-job", job="new", arrive=5.0)
        .job("old", first_arrival=0.0)
        .pin("p", job="old")
    )
    assert list(fcfs.order_waiting(s.build()).request_ids) == ["new-job", "late-of-old-job"]


def test_preempts_newest_arrival_first(fcfs: Policy) -> None:
    s = (
        step()
        .running("old", arrive=1.0)
        .running("newest", arrive=3.0, last=True)
        .running("middle", arrive=2.0)
    )
    assert list(fcfs.order_victims(s.build()).request_ids) == ["newest", "middle", "old"]


def test_releases_every_finish_and_never_pins(fcfs: Policy) -> None:
    s = step().running("r", job="a", arrive=0.0)
    decision = fcfs.on_finish(s.finish("r", tool="ls", samples_s=[0.1] * 10))
    assert decision.action is RetainAction.RELEASE
    assert decision.ttl_s == 0.0


def test_finish_releases_leftover_pins_of_the_job(fcfs: Policy) -> None:
    s = step().running("r2", job="a").pin("r1", job="a").pin("other", job="b")
    assert fcfs.on_finish(s.finish("r2")).release_pins == ("r1",)


def test_no_pressure_relief(fcfs: Policy) -> None:
    s = step(free_blocks=0).waiting("w", prompt=1000).pin("p", job="x", blocks=50)
    assert list(fcfs.release_under_pressure(s.build()).request_ids) == []


def test_expires_pins_at_their_deadline(fcfs: Policy) -> None:
    s = (
        step(now=10.0)
        .pin("past", job="a", expires=9.0)
        .pin("exactly-now", job="b", expires=10.0)
        .pin("future", job="c", expires=10.5)
        .waiting("w", job="a")  # fcfs does not care about waiting requests
    )
    assert sorted(fcfs.expire(s.build()).request_ids) == ["exactly-now", "past"]
