"""Orders become vLLM priorities: the engine must see the policy's order, and a stable
order must cost no messages."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.runtime.priorities import PRIORITY_LIMIT, assign_priorities


def _engine_order(ids: list[str], priorities: dict[str, int],
                  arrival_s: dict[str, float]) -> list[str]:
    # vLLM admits the smallest (priority, arrival_time) first.
    return sorted(ids, key=lambda request_id: (priorities[request_id], arrival_s[request_id]))


@st.composite
def _orders(draw: st.DrawFn) -> tuple[list[str], dict[str, float], dict[str, int]]:
    count = draw(st.integers(0, 30))
    ids = [f"r{index}" for index in range(count)]
    # Few distinct arrival times: ties are where the comparator's fallback matters.
    arrival_s = {request_id: draw(st.sampled_from([0.5, 1.0, 1.5, 2.0])) for request_id in ids}
    order = draw(st.permutations(ids))
    previous = {}
    for request_id in ids:
        if draw(st.booleans()):
            previous[request_id] = draw(st.one_of(
                st.integers(-4, 4).map(lambda gaps: gaps * 1024),
                st.integers(-3, 3),
                st.integers(PRIORITY_LIMIT - 3, PRIORITY_LIMIT - 1)))
    return list(order), arrival_s, previous


@settings(max_examples=400, deadline=None)
@given(_orders())
def test_the_engine_sees_the_policys_order_with_only_the_changes_sent(
        case: tuple[list[str], dict[str, float], dict[str, int]]) -> None:
    order, arrival_s, previous = case
    changes = assign_priorities(order, arrival_s, previous)
    priorities = {**previous, **changes}
    assert _engine_order(order, priorities, arrival_s) == order
    assert all(previous.get(request_id) != value for request_id, value in changes.items())
    assert all(-(1 << 31) <= value < (1 << 31) for value in priorities.values())  # int32


def test_a_queue_that_loses_its_head_and_gains_a_tail_sends_only_the_new_request() -> None:
    arrival_s = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    sent = assign_priorities(["a", "b", "c"], arrival_s, {})
    assert assign_priorities(["b", "c", "d"], arrival_s, sent) == {"d": sent["c"] + 1024}


def test_a_request_moved_ahead_is_the_only_one_renumbered() -> None:
    arrival_s = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    sent = assign_priorities(["a", "b", "c", "d"], arrival_s, {})
    changes = assign_priorities(["a", "d", "b", "c"], arrival_s, sent)
    assert list(changes) == ["d"]
    assert sent["a"] < changes["d"] < sent["b"]
