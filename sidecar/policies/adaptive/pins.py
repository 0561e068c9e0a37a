"""``adaptive``'s pin valuation: at a finish pin, soft-retain or release; every step
re-value each pin and release those no longer worth their memory; order the pins
that give way when an allocation fails; expire pins whose plan is over.

What a pin is worth is ``value.py``'s; the price it is valued at is the step's
(``StepState.pin_price``).
"""

from __future__ import annotations

import math

from sidecar.framework.types import (
    FinishInput,
    Ordering,
    PinRelease,
    PinView,
    PressureOrder,
    RetainAction,
    RetainDecision,
    ToolTimeDistribution,
)
from sidecar.policies.adaptive.admission import admission_order
from sidecar.policies.adaptive.reasons import Reason, Rule
from sidecar.policies.adaptive.state import StepState
from sidecar.policies.adaptive.value import (
    best_plan,
    outlook_of,
    p_return_of,
    pin_value,
    plan_value_s,
    recompute_s,
    retention_priority,
)
from sidecar.policies.base import (
    blocks_to_admit,
    expired_unless_job_waits,
    has_no_job,
    pinned_blocks_by_job,
    superseded_pins,
    tool_distribution,
)

# The reasons that read no figure, rendered once.
_PRESSURE_ORDER = Reason(Rule.PRESSURE_ORDER).text()
_HORIZON_OVER = Reason(Rule.HORIZON_OVER).text()


def on_finish(state: StepState, finished: FinishInput) -> RetainDecision:
    """A last step, and a request with no job, is released. Otherwise the pin is
    valued at elapsed 0 and the pin price: worth more than 0, it is pinned for its
    best horizon; else soft-retained at a priority that rises with P(back within the
    longest horizon). The job's older pins are released either way (one pin per
    job)."""
    superseded = superseded_pins(finished)
    request = finished.request
    if request.is_last_step:
        return RetainDecision.release(Reason(Rule.LAST_STEP).text(), release_pins=superseded)
    if has_no_job(request):
        # Not valued: the tools' times say nothing about a request that has no next
        # turn, and its blocks must not count as a context expected back.
        return RetainDecision.release(Reason(Rule.NO_JOB).text(), release_pins=superseded)
    params = state.params
    step = finished.step
    price = state.pin_price()
    distribution, source = tool_distribution(
        finished.tool, finished.tool_times, finished.global_tool_times, params.min_samples)
    value = pin_value(
        state.valuation,
        outlook_of(state.valuation, distribution, 0.0),
        context_tokens=request.prompt_tokens + finished.output_tokens,
        blocks=finished.blocks,
        total_blocks=step.kv.total_blocks,
        price=price,
        source=source,
    )
    if value.value_s > 0.0 and value.horizon_s > 0.0:
        return RetainDecision.pin(
            value.horizon_s,
            Reason(Rule.PIN, horizon_s=value.horizon_s, value_s=value.value_s, price=price,
                   source=value.source).text(),
            release_pins=superseded)
    priority = _soft_priority(state, value.p_return)
    state.remember_released(request.job_id, finished.blocks)
    return RetainDecision(
        RetainAction.SOFT_RETAIN,
        retention_priority=priority,
        reason=Reason(Rule.SOFT_RETAIN, price=price, longest_horizon_s=params.longest_horizon_s,
                      p_return=value.p_return, source=value.source, priority=priority).text(),
        release_pins=superseded)


def release_under_pressure(state: StepState) -> PinRelease:
    """Release every pin no longer worth its memory (its tool has run long, or memory
    got short; a pin whose job's next request already waits is about to be used and
    is not re-valued). Then, when the first request to admit is overdue or the engine
    idles, and it cannot fit, release the least valuable pins (never its own job's)
    until it fits."""
    price = state.pin_price()  # every step, so the forecasts see idle ones
    step = state.step
    if not step.pins:
        return PinRelease((), "")
    waiting_jobs = state.waiting_jobs
    if price > 0.0:
        released = [pin.request_id for pin in step.pins if pin.job_id not in waiting_jobs
                    and _value_s(state, pin, price) <= 0.0]
    else:  # memory idle: a pin costs nothing unless its job is not coming back
        released = [pin.request_id for pin in step.pins if pin.job_id not in waiting_jobs
                    and _p_return(state, pin) <= 0.0]

    shortfall_blocks = 0
    head = _forced_head(state)
    if head is not None:
        head_job, shortfall_blocks = head
        released_ids = set(released)
        freed = sum(p.blocks for p in step.pins if p.request_id in released_ids)
        # Pins of jobs in a tool, least valuable per block first (a pin whose job's
        # next turn waits is about to be used). An idle engine also takes the pins of
        # other waiting jobs, last: when every pin's job waits and none fits, they
        # would wait on each other until the engine's backstop (max_pin_s) freed them.
        idle = not step.running and step.kv.admission_stalled
        candidates = sorted(
            (p for p in step.pins if p.request_id not in released_ids
             and p.job_id != head_job and (idle or p.job_id not in waiting_jobs)),
            key=lambda p: (p.job_id in waiting_jobs,
                           _value_s(state, p, price) / max(p.blocks, 1),
                           p.request_id))
        for pin in candidates:
            if freed >= shortfall_blocks:
                break
            released.append(pin.request_id)
            freed += pin.blocks
    if not released:
        return PinRelease((), "")
    pin_by_id = {pin.request_id: pin for pin in step.pins}
    priorities = {rid: _soft_priority(state, _p_return(state, pin_by_id[rid]))
                  for rid in released}
    for rid in released:
        pin = pin_by_id[rid]
        state.remember_released(pin.job_id, pin.blocks)
    reason = Reason(Rule.NOT_WORTH_MEMORY, price=price, shortfall_blocks=shortfall_blocks)
    return PinRelease(tuple(released), reason.text(), priorities)


def _forced_head(state: StepState) -> tuple[str, int] | None:
    """(job, blocks short) of the first request to admit when it cannot fit and must
    get in now: it is past its fair share, or nothing runs and the engine could admit
    nothing (it would idle until a pin expires). vLLM admits in order and stops at the
    first request that does not fit.

    Otherwise pins do not give way to a request that does not fit: its blocks come
    from the running requests as they finish (taking the younger jobs' pins for it
    turns overload into thrashing)."""
    step = state.step
    if not step.waiting:
        return None
    order = admission_order(state)
    idle = not step.running and step.kv.admission_stalled
    if not order.overdue and not idle:
        return None
    head = order.ordered[0]
    pinned = pinned_blocks_by_job(step.pins)
    need = blocks_to_admit(head, step.kv.block_size_tokens, pinned.get(head.job_id, 0))
    shortfall = need - step.kv.free_blocks
    if idle:
        shortfall = max(shortfall, 1)
    if shortfall <= 0:
        return None
    return head.job_id, shortfall


def order_pins_under_pressure(state: StepState, victims: Ordering) -> PressureOrder:
    """When a running request's next block cannot be allocated, pins worth less than
    re-computing the first preemption victim give way first (least valuable first);
    the rest are kept and vLLM preempts.

    A pin whose job's next request already waits is about to be used: its loss costs
    its whole re-compute (P(back) = 1, whatever its tool's distribution says), so it
    gives way only if that is less than the victim's, and after every pin of a job
    still in its tool."""
    step = state.step
    if not step.pins:
        return PressureOrder((), None, "")
    victim_ids = victims.request_ids
    victim_cost_s = math.inf
    if victim_ids:
        first_victim = next(r for r in step.running if r.request_id == victim_ids[0])
        victim_cost_s = recompute_s(first_victim, state.prefill_s_per_token)
    price = state.params.memory_price
    waiting_jobs = state.waiting_jobs
    block_tokens = step.kv.block_size_tokens
    prefill_s_per_token = state.prefill_s_per_token
    p_returns = state.p_returns
    # The cheap pins (P(back) x their re-compute below the victim's), ordered by (job
    # waits, value per block, id): sorted one key at a time, least significant first.
    ids: list[str] = []
    values_per_block: list[float] = []
    jobs_wait: list[bool] = []
    for pin in step.pins:
        job_waits = pin.job_id in waiting_jobs
        if job_waits:
            p_back = 1.0
        else:
            known = p_returns.get(pin.request_id)  # _p_return's, without the call
            p_back = known if known is not None else _p_return(state, pin)
        if p_back * (pin.blocks * block_tokens * prefill_s_per_token) < victim_cost_s:
            ids.append(pin.request_id)
            values_per_block.append(_value_s(state, pin, price) / max(pin.blocks, 1))
            jobs_wait.append(job_waits)
    order = sorted(range(len(ids)), key=ids.__getitem__)
    order.sort(key=values_per_block.__getitem__)
    order.sort(key=jobs_wait.__getitem__)
    return PressureOrder(tuple([ids[index] for index in order]), None, _PRESSURE_ORDER)


def expire(state: StepState) -> PinRelease:
    """Pins whose planned horizon was over by the time this step's arrivals are seen
    until, and whose job has no request waiting. Expired at ``now_s``, a pin whose
    horizon ran out during the step just reported would go while its job may be back,
    not shown yet."""
    expired = expired_unless_job_waits(state.step, state.seen_until_s, state.waiting_jobs)
    return PinRelease(expired, _HORIZON_OVER if expired else "")


# --- a pin's value and P(back), once per step ------------------------------------------


def _value_s(state: StepState, pin: PinView, price: float) -> float:
    """What the pin's best plan is worth at ``price`` (<= 0: release it)."""
    values = state.values.get(price)
    if values is None:
        values = state.values[price] = {}
    value_s = values.get(pin.request_id)
    if value_s is None:
        value_s = values[pin.request_id] = _compute_value_s(state, pin, price)
    return value_s


def _distribution(state: StepState, pin: PinView) -> tuple[ToolTimeDistribution | None, str]:
    """The distribution the pin's tool is valued by, and where it came from: once a
    step per tool (the pins of one tool share it)."""
    known = state.distributions.get(pin.tool)
    if known is None:
        step = state.step
        own = step.tool_times.get(pin.tool) if pin.tool else None
        known = state.distributions[pin.tool] = tool_distribution(
            pin.tool, own, step.global_tool_times, state.params.min_samples)
    return known


def _p_return(state: StepState, pin: PinView) -> float:
    """P(the pin's job is back within the longest horizon | its tool's elapsed time):
    two look-ups, where a full valuation takes one per horizon."""
    p_return = state.p_returns.get(pin.request_id)
    if p_return is None:
        known = state.distributions.get(pin.tool)  # _distribution's, without the call
        distribution = (known if known is not None else _distribution(state, pin))[0]
        p_return = state.p_returns[pin.request_id] = p_return_of(
            state.valuation, distribution, _tool_elapsed_s(state, pin))
    return p_return


def _compute_value_s(state: StepState, pin: PinView, price: float) -> float:
    distribution, _ = _distribution(state, pin)
    elapsed_s = _tool_elapsed_s(state, pin)
    kv = state.step.kv
    context_tokens = pin.blocks * kv.block_size_tokens
    if distribution is None or distribution.count == 0:  # the cold start: no outlook
        return plan_value_s(state.valuation, None, elapsed_s, context_tokens, pin.blocks,
                            kv.total_blocks, price)
    # Kept for the step: a pin is valued at the pin price and at the full price when
    # memory is short.
    outlook = state.outlooks.get(pin.request_id)
    if outlook is None:
        outlook = state.outlooks[pin.request_id] = outlook_of(state.valuation, distribution,
                                                              elapsed_s)
    return best_plan(state.valuation, outlook, context_tokens, pin.blocks, kv.total_blocks,
                     price)[0]


def _soft_priority(state: StepState, p_return: float) -> int:
    return retention_priority(p_return, state.params.soft_retain_lowest,
                              state.params.soft_retain_highest)


def _tool_elapsed_s(state: StepState, pin: PinView) -> float:
    """How long the pin's tool is known to have run without its job coming back: up
    to the time the step's arrivals are seen until, not ``now_s``. A job back during
    the step just reported is not in it yet; valued at ``now_s`` its tool would have
    run past every sample, and the pin be released a step before the job's next turn
    showed."""
    return max(state.seen_until_s - pin.pinned_at_s, 0.0)
