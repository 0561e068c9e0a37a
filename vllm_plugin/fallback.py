"""What the engine decides on its own when the daemon's word is missing, late or stale.

The daemon holds the policy; the plugin reports and applies. These are the only
rules the engine applies by itself, all in one place, each one fail-open: it only
ever lets memory go (or keeps cached what it lets go), never holds more than the
daemon asked for, and never reorders requests. With every rule below taken out, the
engine would still be correct, only slower: an engine idling on pins until the
daemon's answer comes, a running request preempted while a pin stays held.

- ``vllm_plugin.ranks.UNRANKED_RANK``: where a request waits, among those of its
  client's priority, until the daemon ranks it.
- :func:`local_bound_s` / :func:`capped_expiry_s`: a pin ends at a bound the engine
  keeps itself, whatever the daemon says or does not say.
- :func:`holds_finished_turn` / :func:`job_is_over`: which finished requests are
  worth holding for the daemon's word at all.
- :func:`idle_release`: the pin that gives way when the engine would otherwise idle.
- :func:`oldest_pin`: the pin that gives way to a running request's allocation when
  the daemon is gone.
- :func:`returned_job_protection`: the retention of a release the daemon decided
  before it knew the job was back.

Pure functions of their arguments; the engine thread calls them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from sidecar.api.retention_ranges import Protection
from sidecar.api.v1 import engine_session_pb2 as pb

if TYPE_CHECKING:
    from vllm_plugin.pins import Pin

# Finish reasons after which a job may come back for its context: the turn stopped
# (a tool call, an answer) or hit its token cap. An aborted or failed request's
# context is not worth holding.
_HOLDABLE_FINISHES = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def local_bound_s(pin: Pin, connected: bool, max_pin_s: float) -> float:
    """The engine clock at which ``pin`` is released, whatever the daemon says.

    Connected and confirmed, the daemon decides expiry (it may keep a pin past its
    TTL while the job's next turn waits) and ``max_pin_s`` is only the backstop.
    Disconnected or never confirmed, the pin's own bound decides: the provisional
    bound, or the daemon's expiry as last confirmed. Safe: a pin only ends sooner."""
    if pin.confirmed and connected:
        return pin.pinned_at_s + max_pin_s
    return pin.release_at_s


def capped_expiry_s(pinned_at_s: float, expires_at_s: float, max_pin_s: float) -> float:
    """A confirmed pin's local bound: the daemon's expiry, never past ``max_pin_s``
    after the pin was made (a daemon that confirms and then goes quiet cannot hold
    memory for longer)."""
    return min(expires_at_s, pinned_at_s + max_pin_s)


def holds_finished_turn(job_id: str, is_last_step: bool, reason: pb.FinishReason) -> bool:
    """Whether a finished request's blocks are worth holding until the daemon decides
    (when its policy asks for provisional pins). Not without a job (no job id, no
    session): it has no next turn to keep them for, and holding them only squeezes
    everyone else. Not the job's last step, not an aborted or failed request."""
    return bool(job_id) and not is_last_step and reason in _HOLDABLE_FINISHES


def job_is_over(job_id: str, is_last_step: bool) -> bool:
    """The job's last step finished: no pin of the job can serve another turn, so its
    pins are released at once, not at the daemon's word, and an engine going idle
    never holds them."""
    return is_last_step and bool(job_id)


def idle_release(pins: Iterable[Pin], pressure_order: Sequence[str], head_job: str,
                 waiting_jobs: Collection[str]) -> Pin:
    """The pin to release when nothing runs and the first waiting request (of job
    ``head_job``) does not fit beside the pins; one a step, the next step retries the
    admission. Order: the daemon's pressure order (least valuable first), then the
    pins of jobs with no request waiting, then the other waiting jobs' pins, oldest
    first; the head request's own job last.

    The daemon would release them too, a round trip later, while the engine idled.
    Safe: a released pin's blocks stay in the prefix cache, so a job that comes back
    still hits whatever is not evicted by then. ``pins`` must not be empty."""
    ranked = {request_id: rank for rank, request_id in enumerate(pressure_order)}
    return min(pins, key=lambda pin: (
        bool(head_job) and pin.job_id == head_job,
        ranked.get(pin.request_id, len(ranked)),
        pin.job_id in waiting_jobs,
        pin.pinned_at_s))


def oldest_pin(pins: Iterable[Pin]) -> Pin:
    """The pin that gives way when a running request's allocation fails and the daemon
    is gone: vLLM itself holds no pins, so any pin yields before vLLM preempts a
    running request; the oldest is the least likely to be used again. ``pins`` must
    not be empty."""
    return min(pins, key=lambda pin: pin.pinned_at_s)


def returned_job_protection(protection: Protection | None,
                            returned_job_priority: int) -> Protection:
    """The retention of a stale release: the daemon released a job's newest context
    answering a report older than the job's latest request, deciding while the job
    looked away in a tool, and the job is back. The blocks are freed all the same
    (holding them until the daemon decides again held memory the waiting turn could
    not use yet, and every other request waited behind it), but cached at the
    policy's priority raised to ``returned_job_priority``, for the duration the
    policy named (none: until evicted), so the returning turn still finds its
    context. Safe: it only orders eviction among free blocks."""
    if protection is None:
        return Protection(returned_job_priority, None)
    return Protection(max(returned_job_priority, protection.priority), protection.duration_s)
