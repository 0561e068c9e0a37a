"""What a step report may carry: the engine session's edge.

A report that breaks a rule is refused whole, naming the first bad field
(``events[3].at_s: must be a finite number >= 0, got inf``); nothing of it reaches the
mirror, the job tracker or the store. Every field obeys the wire's general rules
(:mod:`sidecar.api.messages`: finite numbers, defined enum values, bounded ids and
tool names); the rules here are what the fields mean.
"""

from __future__ import annotations

import math

from sidecar.api.bounds import (
    RESERVED_TOOL_NAMES,
    FieldError,
    check_text,
    check_time,
    check_tool,
)
from sidecar.api.messages import check_message
from sidecar.api.v1 import engine_session_pb2 as pb

# The name the engine session and its callers know a refused report's error by.
InvalidReport = FieldError

# Far more than any engine holds; a larger report is malformed, not big.
MAX_ITEMS_PER_REPORT = 65_536
# The plugin's decision-lag histogram has a handful of buckets, and each bucket
# becomes a metric series per engine: more is malformed, and costs memory and scrapes.
MAX_LAG_BUCKETS = 64
# Longer than any engine step: a report whose steps took more than this each carries
# a clock that jumped, not work (and would swamp the engine's step-cost fit).
MAX_STEP_S = 3600.0
# A request's own retention directives are the resolver's to judge: it ignores an
# invalid one, so that one client's directive never refuses its engine's report.
_JUDGED_ELSEWHERE = frozenset({"new_requests.retention"})


def _is_time(value: float) -> bool:
    """Finite and not negative (``check_time``'s rule, without naming the field)."""
    return 0.0 <= value < math.inf


def validate_report(report: pb.StepReport) -> None:
    """Raise :data:`InvalidReport` naming the first field that breaks a rule."""
    items = (len(report.new_requests) + len(report.events) + len(report.pins)
             + len(report.released_pins))
    if items > MAX_ITEMS_PER_REPORT:
        lists = ("new_requests", "events", "pins", "released_pins")
        largest = max(lists, key=lambda name: len(getattr(report, name)))
        raise InvalidReport(largest, f"{items} items in one report ({', '.join(lists)} "
                                     f"together) exceed {MAX_ITEMS_PER_REPORT}")
    buckets = len(report.counters.answers_by_lag_steps)
    if buckets > MAX_LAG_BUCKETS:
        raise InvalidReport("counters.answers_by_lag_steps",
                            f"{buckets} buckets exceed {MAX_LAG_BUCKETS}")
    check_message(report, skip=_JUDGED_ELSEWHERE)
    check_text("engine_id", report.engine_id, required=True)
    if report.seq == 0:
        raise InvalidReport("seq", "must start at 1")
    check_time("now_s", report.now_s)
    kv = report.kv
    if kv.free_blocks > kv.total_blocks:
        raise InvalidReport("kv.free_blocks",
                            f"{kv.free_blocks} exceed kv.total_blocks {kv.total_blocks}")
    # Without capacity in this report, a request's blocks are not checked against it.
    total_blocks = kv.total_blocks if report.HasField("kv") else math.inf
    seen: set[str] = set()
    for index, new in enumerate(report.new_requests):
        if not new.request_id:
            raise InvalidReport(f"new_requests[{index}].request_id", "must not be empty")
        if new.request_id in seen:
            raise InvalidReport(f"new_requests[{index}].request_id",
                                f"duplicate id {new.request_id!r}")
        seen.add(new.request_id)
        if not _is_time(new.arrival_s):
            check_time(f"new_requests[{index}].arrival_s", new.arrival_s)
        if new.tool_hint in RESERVED_TOOL_NAMES:  # its length: checked above
            check_tool(f"new_requests[{index}].tool_hint", new.tool_hint)
    for index, event in enumerate(report.events):
        if not event.request_id:
            raise InvalidReport(f"events[{index}].request_id", "must not be empty")
        if event.kind == pb.EVENT_KIND_UNSPECIFIED:
            raise InvalidReport(f"events[{index}].kind", "must be set")
        if not _is_time(event.at_s):
            check_time(f"events[{index}].at_s", event.at_s)
        if event.tool in RESERVED_TOOL_NAMES:
            check_tool(f"events[{index}].tool", event.tool)
        if event.blocks > total_blocks:
            _refuse_blocks(f"events[{index}].blocks", event.blocks, total_blocks)
    for index, pin in enumerate(report.pins):
        if not pin.request_id:
            raise InvalidReport(f"pins[{index}].request_id", "must not be empty")
        if not _is_time(pin.pinned_at_s):
            check_time(f"pins[{index}].pinned_at_s", pin.pinned_at_s)
        if not _is_time(pin.expires_at_s):
            check_time(f"pins[{index}].expires_at_s", pin.expires_at_s)
        if pin.tool in RESERVED_TOOL_NAMES:
            check_tool(f"pins[{index}].tool", pin.tool)
        if pin.blocks > total_blocks:
            _refuse_blocks(f"pins[{index}].blocks", pin.blocks, total_blocks)
    # The engine's counters are cumulative: a negative one would run its exported
    # counter backwards (the integer ones cannot be negative on the wire).
    check_time("counters.provisional_block_seconds", report.counters.provisional_block_seconds)
    work = report.work
    check_time("work.busy_s", work.busy_s)
    if work.busy_s > max(work.steps, 1) * MAX_STEP_S:
        raise InvalidReport("work.busy_s", f"{work.busy_s!r} s for {work.steps} steps exceed "
                                           f"{MAX_STEP_S:g} s a step")


def _refuse_blocks(field: str, blocks: int, total_blocks: float) -> None:
    raise InvalidReport(field, f"{blocks} exceed kv.total_blocks {total_blocks}")
