"""``adaptive``'s admission: overdue requests first, then job-level order, and
arrival order while the engine keeps up.

A request is overdue once it has waited ``overdue_multiple`` fair shares; its fair
share is the wait arrival order (FCFS) would give it. Past the overdue requests, the
jobs holding a pin go first, oldest job first (Continuum's order), then every other
request by its job's age, credited at most ``credit_s`` (README.md, "Admission").
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.framework.types import Ordering, RequestView
from sidecar.policies.adaptive.reasons import CreditScope, Reason, Rule
from sidecar.policies.adaptive.state import StepState
from sidecar.policies.base import blocks_to_admit, job_first_arrivals

# Attribute readers that run in C: a step reads them once a request.
_request_id = operator.attrgetter("request_id")
_arrival_s = operator.attrgetter("arrival_s")


@dataclass(frozen=True, slots=True)
class AdmissionOrder:
    """The waiting requests in admission order, how many are overdue, and whether the
    engine keeps up (the order is then arrival order)."""

    ordered: list[RequestView]
    overdue: int
    keeping_up: bool


def order_waiting(state: StepState) -> Ordering:
    order = admission_order(state)
    ids = tuple(map(_request_id, order.ordered))
    params = state.params
    if order.keeping_up:
        return Ordering(ids, Reason(Rule.ARRIVAL_ORDER,
                                    min_fair_share_s=params.min_fair_share_s).text())
    share = prefill_share(state)
    return Ordering(ids, Reason(
        Rule.JOB_ORDER, overdue=order.overdue, overdue_multiple=overdue_multiple(state),
        credit_s=params.credit_s, credited=credit_scope(state, share),
        prefill_share=share).text())


def admission_order(state: StepState) -> AdmissionOrder:
    if state.admission is None:
        state.admission = _admission_order(state)
    return state.admission


def prefill_share(state: StepState) -> float:
    """The share of its time the engine spent computing prompts lately (0 before it
    is known): the rate its reports carry times what a token costs."""
    per_s = state.step.prefill_tokens_per_s
    return 0.0 if per_s is None else per_s * state.prefill_s_per_token


def credit_scope(state: StepState, share: float) -> CreditScope:
    """Which waiting requests of jobs holding no pin are credited their job's age:
    every one on an engine saturated by prefill, else only those that fit in the free
    blocks. vLLM admits in order and stops at the first request that does not fit; an
    engine with time to spare would leave the requests that fit behind it waiting for
    nothing, a saturated one would only share its time with them."""
    return "all" if share >= state.params.saturated_prefill_share else "fitting"


def overdue_multiple(state: StepState) -> float:
    """How many fair shares a request waits before it goes first:
    ``fair_share_multiple`` while memory is idle, up to ``1 + overdue_widening`` times
    that as memory gets short (scaled by ``price / memory_price``). Admitting an
    overdue request costs the working sets its blocks displace: none while memory is
    idle, the contexts of the jobs in flight when it is short."""
    params = state.params
    multiple = params.fair_share_multiple
    if params.memory_price <= 0.0 or params.overdue_widening == 0.0:
        return multiple
    shortage = state.pressure.price / params.memory_price
    return multiple * (1.0 + params.overdue_widening * shortage)


def fair_share_s(state: StepState, fcfs_factor: float = 1.0) -> float:
    """The wait arrival order would give a request arriving now: by Little's law the
    requests waiting over the rate FCFS would admit them (``L / λ``, λ this engine's
    admission rate times ``fcfs_factor``); at least ``min_fair_share_s``, and that
    least while the rate is not known yet. The rate is the one this engine achieves,
    so while a backlog builds the share grows with it, and the jobs in flight go on
    finishing first instead of being evicted by new ones forced in.

    Called every step: it records the step's running requests, from which the rate
    counts admissions."""
    step = state.step
    rate_per_s = state.memory.admissions.update(
        step.engine_id, step.now_s, frozenset(map(_request_id, step.running)))
    fcfs_rate_per_s = rate_per_s * fcfs_factor
    little_s = len(step.waiting) / fcfs_rate_per_s if fcfs_rate_per_s > 0.0 else 0.0
    return max(little_s, state.params.min_fair_share_s)


def overdue_request_ids(state: StepState, multiple: float) -> set[str]:
    """The waiting requests that have waited more than ``multiple`` fair shares.

    A request's fair share: the lesser of the wait arrival order gives a request
    arriving now (``fair_share_s``) and, once arrival order would have admitted this
    one, the wait it gave it (``ArrivalOrderClock``, fixed once due: it does not grow
    with a backlog that built after the request arrived); at least
    ``min_fair_share_s``. Both count the engine's admissions at what they are worth to
    FCFS, which re-computes what this engine kept when memory is short and so admits
    fewer (``FcfsRecompute``)."""
    step = state.step
    memory = state.memory
    due_at_s = memory.arrival_order.update(step.engine_id, step.now_s, step.waiting,
                                           step.running, _fcfs_weigh(state))
    now_share_s = fair_share_s(state, memory.fcfs_recompute.factor(step.engine_id))
    least_s = state.params.min_fair_share_s
    now_s = step.now_s
    due_get = due_at_s.get
    # The bound of a request arrival order has not reached yet (most of them).
    not_due_bound_s = multiple * now_share_s
    return {request.request_id for request in step.waiting
            if now_s - request.arrival_s > (
                not_due_bound_s if (due_s := due_get(request.request_id)) is None
                else multiple * min(now_share_s, max(due_s - request.arrival_s, least_s)))}


def _fcfs_weigh(state: StepState) -> Callable[[list[RequestView]], float]:
    """What each admission of this step is worth in FCFS's admissions: fewer the more
    of the contexts this engine kept FCFS would have re-computed, memory short."""
    params = state.params
    shortage = (state.waiting_price() / params.memory_price
                if params.memory_price > 0.0 else 0.0)
    step = state.step

    def weigh(admitted: list[RequestView]) -> float:
        return state.memory.fcfs_recompute.update(
            step.engine_id, step.now_s, admitted, state.first_turn,
            state.prefill_s_per_token, shortage)
    return weigh


def _keeping_up(state: StepState) -> bool:
    """Memory is idle (the waiting requests fit in the free blocks) and no request has
    waited a full minimum fair share. Job-level order then protects no working set and
    only delays new jobs behind the turns of older ones for a few steps."""
    if state.pressure.price > 0.0:
        return False
    step = state.step
    # now_s - the earliest arrival: the longest wait, exactly (subtraction is monotone).
    oldest_wait_s = (step.now_s - min(map(_arrival_s, step.waiting)) if step.waiting
                     else 0.0)
    return oldest_wait_s <= state.params.min_fair_share_s


def _admission_order(state: StepState) -> AdmissionOrder:
    """Overdue requests first, oldest first; then the jobs holding a pin, oldest job
    first (the turn uses the pin and frees it, and no new job takes its blocks); then
    the others by their job's age, credited at most ``credit_s``: a request ranks as
    if it had arrived that much earlier, or when its job did if that is later. Below
    saturation only a request that fits in the free blocks is credited; one that does
    not keeps its place in arrival order."""
    step = state.step
    overdue = overdue_request_ids(state, overdue_multiple(state))
    if _keeping_up(state):
        # Nothing to protect: arrival order, as FCFS (oldest first, overdue or not).
        ordered = sorted(step.waiting, key=lambda r: (r.arrival_s, r.request_id))
        return AdmissionOrder(ordered, len(overdue), True)
    waiting = step.waiting
    jobs = step.jobs
    # Jobs the tracker sent no view for (rare): job_first_arrivals' fallback.
    untracked_first_s: dict[str, float] | None = None
    pinned_jobs = {pin.job_id for pin in step.pins}
    credit_s = state.params.credit_s
    every_one = credit_scope(state, prefill_share(state)) == "all"
    free_blocks = step.kv.free_blocks
    block_tokens = step.kv.block_size_tokens
    # A prompt of at most this many tokens fits whatever it has computed
    # (blocks_to_admit <= its prompt's blocks): most do, without the call.
    fitting_tokens = free_blocks * block_tokens
    # Overdue requests first, by (arrival, id); then the others by (rank, first,
    # arrival, id), rank 1: the job holds a pin, first its first arrival; 2: first its
    # credited age. Each part sorted one key at a time, least significant first (every
    # sort stable), by keys read in C: no key tuple a request for the garbage
    # collector to count.
    head: list[RequestView] = []
    rest: list[RequestView] = []
    ranks: list[int] = []
    firsts: list[float] = []
    for request in waiting:
        if request.request_id in overdue:
            head.append(request)
            continue
        rest.append(request)
        job = jobs.get(request.job_id)
        if job is not None:
            first_s = job.first_arrival_s
        else:
            if untracked_first_s is None:
                untracked_first_s = job_first_arrivals(step, waiting)
            first_s = untracked_first_s[request.job_id]
        if request.job_id in pinned_jobs:
            ranks.append(1)
            firsts.append(first_s)
        elif (every_one or request.prompt_tokens <= fitting_tokens
              or blocks_to_admit(request, block_tokens, 0) <= free_blocks):
            ranks.append(2)
            firsts.append(max(first_s, request.arrival_s - credit_s))
        else:
            ranks.append(2)
            firsts.append(request.arrival_s)
    head.sort(key=_request_id)
    head.sort(key=_arrival_s)
    ids = list(map(_request_id, rest))
    arrivals_s = list(map(_arrival_s, rest))
    order = sorted(range(len(rest)), key=ids.__getitem__)
    order.sort(key=arrivals_s.__getitem__)
    order.sort(key=firsts.__getitem__)
    order.sort(key=ranks.__getitem__)
    head.extend(rest[index] for index in order)
    ordered = head
    return AdmissionOrder(ordered, len(overdue), False)
