"""Why ``adaptive`` decided what it did: a rule and the figures it read, rendered to the
text Explain shows in one place (``Reason.text``)."""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

# Which waiting requests of jobs holding no pin are credited their job's age.
CreditScope = Literal["all", "fitting"]

_CREDITED: dict[CreditScope, str] = {"all": "every one",
                                     "fitting": "those that fit in the free blocks"}


class Rule(enum.Enum):
    ARRIVAL_ORDER = "arrival_order"  # order_waiting: the engine keeps up
    JOB_ORDER = "job_order"  # order_waiting: overdue first, then by job
    VICTIMS = "victims"  # order_victims
    LAST_STEP = "last_step"  # on_finish
    NO_JOB = "no_job"  # on_finish
    PIN = "pin"  # on_finish
    SOFT_RETAIN = "soft_retain"  # on_finish
    NOT_WORTH_MEMORY = "not_worth_memory"  # release_under_pressure
    PRESSURE_ORDER = "pressure_order"  # order_pins_under_pressure
    HORIZON_OVER = "horizon_over"  # expire


class Reason(NamedTuple):
    """A rule and the figures it read; fields a rule does not read keep their
    defaults. A named tuple: every hook builds one, every step."""

    rule: Rule
    # order_waiting
    min_fair_share_s: float = 0.0
    overdue: int = 0
    overdue_multiple: float = 0.0
    credit_s: float = 0.0
    credited: CreditScope = "all"
    prefill_share: float = 0.0
    # pins
    price: float = 0.0
    horizon_s: float = 0.0
    value_s: float = 0.0
    source: str = ""
    longest_horizon_s: float = 0.0
    p_return: float = 0.0
    priority: int = 0
    # release_under_pressure: blocks the first request to admit is short (0: none
    # forced in)
    shortfall_blocks: int = 0

    def text(self) -> str:
        rule = self.rule
        if rule is Rule.ARRIVAL_ORDER:
            body = (f"engine keeping up (memory idle, no wait past "
                    f"{self.min_fair_share_s:g} s): arrival order")
        elif rule is Rule.JOB_ORDER:
            body = ("jobs holding a pin first, oldest job first; then the others, by job "
                    f"age up to {self.credit_s:g} s ({_CREDITED[self.credited]}: the "
                    f"engine prefills {self.prefill_share:.0%} of its time)")
            if self.overdue:
                body = (f"{self.overdue} request(s) past {self.overdue_multiple:.3g}x fair "
                        f"share first, oldest first; then {body}")
        elif rule is Rule.VICTIMS:
            body = "newest non-last-step job preempted first, then newest job"
        elif rule is Rule.LAST_STEP:
            body = "last step of the job"
        elif rule is Rule.NO_JOB:
            body = "no job id: a job of one turn, left to vLLM's order"
        elif rule is Rule.PIN:
            body = (f"pin {self.horizon_s:g} s worth {self.value_s:.3g} s at memory price "
                    f"{self.price:.2f} ({self.source})")
        elif rule is Rule.SOFT_RETAIN:
            body = (f"no pin repays its memory at price {self.price:.2f} (P(back within "
                    f"{self.longest_horizon_s:g} s)={self.p_return:.2f}, {self.source}): "
                    f"cached at priority {self.priority}")
        elif rule is Rule.NOT_WORTH_MEMORY:
            body = f"not worth its memory at price {self.price:.2f}"
            if self.shortfall_blocks:
                body += (f"; the first request to admit is overdue or the engine idles, "
                         f"{self.shortfall_blocks} blocks short: least valuable pins "
                         f"give way")
        elif rule is Rule.PRESSURE_ORDER:
            body = "pins worth less than re-computing the next victim give way first"
        else:
            body = "planned horizon over and no request of the job waiting"
        return f"adaptive: {body}"
