"""What a pin is worth right now, in seconds of engine time.

A pin held for at most ``h`` more seconds is worth

    value(h) = P(back within h | has run e) * recompute_s  -  price * share * E[held | e, h]

- ``P(back within h | has run e)``: the tool's measured duration distribution,
  conditioned on the ``e`` seconds it has already run (a tool that has run long is
  likely to run longer);
- ``recompute_s``: prefill time of the context the pin keeps (what the next turn pays
  if the blocks are evicted);
- ``share``: the pin's fraction of the KV cache; ``E[held]``: how long it is expected
  to be held (until the tool returns, at most ``h``);
- ``price``: seconds of engine time that holding the *whole* cache for one second
  costs. 0 when the free blocks cover what the waiting requests need (a pin then
  takes nothing from anyone), up to ``memory_price`` when they cover none of it.

This is InferCept's keep-versus-discard comparison of memory-time (arXiv 2402.01869)
with the price set by the current shortage instead of assumed always high, and
Continuum's CDF TTL (``argmax_h P * benefit - cost``) re-evaluated every step with the
elapsed time instead of fixed at the finish.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from sidecar.framework.types import RequestView, StepView, ToolTimeDistribution
from sidecar.policies.base import blocks_to_admit, pinned_blocks_by_job


class Pressure(NamedTuple):
    """Memory pressure at one step (a named tuple: one is built for every view of a
    step)."""

    free_blocks: int
    # Blocks the waiting requests still need (beyond their job's pins).
    demand_blocks: int
    # Engine seconds per (whole cache x second), in [0, memory_price].
    price: float


def memory_pressure(step: StepView, memory_price: float,
                    released_blocks: int = 0) -> Pressure:
    """The price of memory from the waiting demand against the free blocks. An engine
    that could admit nothing although requests wait is short whatever the estimate
    says (vLLM also keeps a watermark and lookahead slots the estimate cannot see).

    ``released_blocks``: the cached contexts of jobs in a tool that are expected back
    (``ReleasedContexts``). While the waiting requests fit in the free blocks, those
    contexts want the rest of the pool to stay cached: the price is their shortfall,
    and a pin that holds blocks they need is not free (on a small cache, pins of
    small contexts would cost the biggest ones their cache). Once the waiting requests
    need every free block they evict those contexts whatever the pins do, and the
    price is the waiting demand's alone."""
    demand = step.kv.waiting_demand_blocks
    if demand is None:  # an older plugin: each request's blocks, shared or not
        pinned = pinned_blocks_by_job(step.pins)
        size = step.kv.block_size_tokens
        demand = sum(blocks_to_admit(r, size, pinned.get(r.job_id, 0)) for r in step.waiting)
    free = step.kv.free_blocks
    if step.kv.admission_stalled and step.waiting:
        waiting = Pressure(free, max(demand, free + 1), memory_price)
    elif demand <= free or demand <= 0:
        waiting = Pressure(free, demand, 0.0)
    else:
        waiting = Pressure(free, demand, memory_price * (demand - free) / demand)
    if released_blocks <= 0:
        return waiting
    return Pressure(free, demand, price_with_released(waiting, memory_price, released_blocks))


def price_with_released(waiting: Pressure, memory_price: float, released_blocks: int) -> float:
    """The price of ``waiting`` (the waiting demand's pressure) counting also the
    released contexts' ``released_blocks`` while the waiting requests fit
    (``memory_pressure``), from the step's pressure already computed."""
    if waiting.demand_blocks >= waiting.free_blocks:
        return waiting.price  # the waiting requests take every free block
    wanted = waiting.demand_blocks + released_blocks
    if wanted <= waiting.free_blocks:
        return 0.0
    return memory_price * (wanted - waiting.free_blocks) / wanted


class PinValue(NamedTuple):
    """The best plan for one pin: keep it ``horizon_s`` more (0: release now). A named
    tuple: one is built for every pin valued at every step."""

    value_s: float  # engine seconds saved by the best plan (<= 0: release)
    horizon_s: float
    # P(the tool is back within the longest horizon considered): how likely the
    # blocks are to be used at all; sets the retention priority when released.
    p_return: float
    source: str


class Valuation(NamedTuple):
    """Inputs that do not depend on the pin (a named tuple: one is built for every view
    of a step)."""

    prefill_s_per_token: float
    horizons_s: Sequence[float]
    cold_start_probability: float
    cold_start_horizon_s: float


Outlook = tuple[tuple[float, float], ...]


def outlook_of(valuation: Valuation, distribution: ToolTimeDistribution | None,
               elapsed_s: float) -> Outlook:
    """(P(back within h | ran elapsed_s), expected seconds held within h) for every
    horizon h; with no samples, the cold-start guess (a coin flip within the cold-start
    horizon, nothing after it)."""
    if distribution is None or distribution.count == 0:
        left_s = max(valuation.cold_start_horizon_s - elapsed_s, 0.0)
        if left_s <= 0.0:  # past the cold-start horizon: not expected back
            return ((0.0, 0.0),) * len(valuation.horizons_s)
        p = valuation.cold_start_probability
        return tuple([(p, left_s) if h >= left_s else (p * h / left_s, h)
                      for h in valuation.horizons_s])
    return distribution.conditional_outlook(elapsed_s, valuation.horizons_s)


def p_return_of(valuation: Valuation, distribution: ToolTimeDistribution | None,
                elapsed_s: float) -> float:
    """P(back within the longest horizon | ran elapsed_s): the last entry of
    :func:`outlook_of`, without the other horizons'."""
    if distribution is None or distribution.count == 0:
        left_s = max(valuation.cold_start_horizon_s - elapsed_s, 0.0)
        if left_s <= 0.0:
            return 0.0
        longest_s = valuation.horizons_s[-1]
        p = valuation.cold_start_probability
        return p if longest_s >= left_s else p * longest_s / left_s
    return distribution.probability_within_given(elapsed_s, valuation.horizons_s[-1])


def pin_value(
    valuation: Valuation,
    outlook: Outlook,
    *,
    context_tokens: int,
    blocks: int,
    total_blocks: int,
    price: float,
    source: str,
) -> PinValue:
    """The best horizon for a pin of ``blocks`` blocks keeping ``context_tokens``
    tokens, given its tool's ``outlook`` (:func:`outlook_of`), at memory ``price``."""
    best_value_s, best_horizon_s = best_plan(valuation, outlook, context_tokens, blocks,
                                             total_blocks, price)
    p_return = outlook[-1][0] if outlook else 0.0
    return PinValue(best_value_s, best_horizon_s, p_return, source)


def best_plan(valuation: Valuation, outlook: Outlook, context_tokens: int, blocks: int,
              total_blocks: int, price: float) -> tuple[float, float]:
    """(value, horizon) of :func:`pin_value`'s best plan, alone: what re-valuing a pin
    every step reads."""
    recompute_s = context_tokens * valuation.prefill_s_per_token
    share = blocks / total_blocks if total_blocks > 0 else 0.0
    cost_per_held_s = price * share
    best_value_s, best_horizon_s = 0.0, 0.0
    for horizon_s, (p, held_s) in zip(valuation.horizons_s, outlook, strict=True):
        value_s = p * recompute_s - cost_per_held_s * held_s
        if value_s > best_value_s:
            best_value_s, best_horizon_s = value_s, horizon_s
    return best_value_s, best_horizon_s


def plan_value_s(valuation: Valuation, distribution: ToolTimeDistribution | None,
                 elapsed_s: float, context_tokens: int, blocks: int, total_blocks: int,
                 price: float) -> float:
    """The value of :func:`best_plan` on ``outlook_of(valuation, distribution,
    elapsed_s)``, exactly, without building the cold-start outlook: what re-valuing a
    pin every step reads."""
    if distribution is not None and distribution.count > 0:
        outlook = distribution.conditional_outlook(elapsed_s, valuation.horizons_s)
        return best_plan(valuation, outlook, context_tokens, blocks, total_blocks, price)[0]
    left_s = max(valuation.cold_start_horizon_s - elapsed_s, 0.0)
    if left_s <= 0.0:  # every horizon (0, 0): worth 0 x recompute - cost x 0, never > 0
        return 0.0
    recompute_s = context_tokens * valuation.prefill_s_per_token
    share = blocks / total_blocks if total_blocks > 0 else 0.0
    cost_per_held_s = price * share
    p = valuation.cold_start_probability
    # Every horizon from left_s on has the outlook (p, left_s), so the same value.
    past_value_s = p * recompute_s - cost_per_held_s * left_s
    best_value_s = 0.0
    for horizon_s in valuation.horizons_s:
        value_s = (past_value_s if horizon_s >= left_s
                   else p * horizon_s / left_s * recompute_s - cost_per_held_s * horizon_s)
        if value_s > best_value_s:
            best_value_s = value_s
    return best_value_s


def recompute_s(request: RequestView, prefill_s_per_token: float) -> float:
    """Prefill seconds a request's prompt costs again if its KV is lost."""
    return max(request.prompt_tokens, request.computed_tokens) * prefill_s_per_token


def retention_priority(p_return: float, lowest: int, highest: int) -> int:
    """A released pin's eviction priority: the likelier its job is back soon, the
    later its blocks are evicted (vLLM's own free blocks sit at 35)."""
    if math.isnan(p_return):
        p_return = 0.0
    return lowest + round((highest - lowest) * min(max(p_return, 0.0), 1.0))
