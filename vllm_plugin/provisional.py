"""Finished turns' blocks kept cached, not held, while the daemon decides whether to pin.

A policy that pins finished turns asks the engine to keep each finished non-last
turn's blocks until its answer lands (``StepDecision.provisional_pins``). Held, those
blocks are out of everyone's reach for the answer's lag: on a saturated engine, whose
answers land several steps late, that can be most of what the pinning policies' pins
hold (``EngineCounters.provisional_block_seconds`` counts it).

Cached instead (``StepDecision.provisional_cache``), the blocks are freed at once at
the top retention priority for the same local bound: no allocation waits on them,
and the pool evicts them only after every other free block. The daemon's PIN takes
back the longest prefix that still holds its content (the prefix is what a next turn
hits); its RELEASE lowers them to the priority it names, or vLLM's own.

The plugin owns this priority under its own scope (:data:`SCOPE`), so it can lower it
again; a request with retention directives of its own is held, not cached (its
owner's priorities are not the plugin's to change). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.api.retention_ownership import ANONYMOUS
from sidecar.api.retention_ranges import DEFAULT, Protection

# The retention scope the plugin's provisional priority is owned by: no client scope
# (a tenant's name) can contain the colon.
SCOPE = "kvtether:provisional"
# Evicted after every other free block, while the daemon decides.
PROVISIONAL_PRIORITY = 100


@dataclass(slots=True)
class Provisional:
    """A finished turn's blocks, freed at the provisional priority, awaiting the word."""

    request_id: str
    job_id: str
    blocks: list[Any]  # vLLM KVCacheBlocks, allocation order (one KV cache group)
    block_hashes: list[Any]  # what each held when freed
    finished_at_s: float
    release_at_s: float  # the local bound: the pool drops the priority then too
    last_sched_seq: int
    tool: str


class ProvisionalCache:
    """Finished turns awaiting the daemon's word, by request id. ``retention`` is the
    block pool's handle (``vllm_plugin.retention.Retention``; its ``pool`` the pool)."""

    def __init__(self, retention: Any, clock_s: Callable[[], float]) -> None:
        self.retention = retention
        self.clock_s = clock_s
        self.waiting: dict[str, Provisional] = {}

    def keep(self, request_id: str, job_id: str, blocks: Sequence[Any], bound_s: float,
             last_sched_seq: int, tool: str) -> bool:
        """Before vLLM frees a finished turn's ``blocks``: give them the provisional
        priority (queued at it once vLLM frees them). False: not kept (a block a named
        scope protects: its owner's, not the plugin's to lower), and the caller holds
        them instead. An anonymous priority (the policy's soft retention of an earlier
        turn, whose blocks this one reused) is the policy's: its next word re-sets it."""
        for block in blocks:
            entry = self.retention.entry(block.block_id)
            if entry is not None and entry.owner not in (ANONYMOUS, SCOPE):
                return False
        now_s = self.clock_s()
        protection = Protection(PROVISIONAL_PRIORITY, bound_s)
        self.retention.retain(blocks, [protection] * len(blocks), SCOPE)
        self.waiting[request_id] = Provisional(
            request_id=request_id, job_id=job_id, blocks=list(blocks),
            block_hashes=[block.block_hash for block in blocks], finished_at_s=now_s,
            release_at_s=now_s + bound_s, last_sched_seq=last_sched_seq, tool=tool)
        return True

    def take(self, request_id: str) -> list[Any] | None:
        """The daemon pins it: take back the longest prefix of its blocks that still
        holds its content, priority lowered (the pin holds them now). None: not
        waiting here; an empty list: all evicted (nothing to pin)."""
        kept = self.waiting.pop(request_id, None)
        if kept is None:
            return None
        prefix = []
        for block, block_hash in zip(kept.blocks, kept.block_hashes, strict=True):
            if block.is_null or block_hash is None or block.block_hash != block_hash:
                break
            prefix.append(block)
        if prefix:
            self.retention.pool.touch(prefix)  # out of the free queue, ref_cnt + 1
            self.retention.retain(prefix, [DEFAULT] * len(prefix), SCOPE)
        self._lower(kept.blocks[len(prefix):], kept.block_hashes[len(prefix):])
        return prefix

    def release(self, request_id: str, protection: Protection | None = None) -> bool:
        """The daemon releases it: back to vLLM's priority, then ``protection`` (the
        policy's soft retention, anonymous: it raises only). False: not waiting here."""
        kept = self.waiting.pop(request_id, None)
        if kept is None:
            return False
        self._lower(kept.blocks, kept.block_hashes)
        if protection is not None:
            self.retention.retain_freed(kept.blocks, kept.block_hashes,
                                        [protection] * len(kept.blocks), "")
        return True

    def release_job(self, job_id: str) -> None:
        for kept in [k for k in self.waiting.values() if k.job_id == job_id]:
            self.release(kept.request_id)

    def expire(self, now_s: float) -> int:
        """Lower and forget what passed its local bound (no word came). Returns how many."""
        expired = [k.request_id for k in self.waiting.values() if k.release_at_s <= now_s]
        for request_id in expired:
            self.release(request_id)
        return len(expired)

    def clear(self) -> None:
        """Forget everything and lower what is still queued at the provisional priority."""
        for request_id in list(self.waiting):
            self.release(request_id)

    def _lower(self, blocks: Sequence[Any], block_hashes: Sequence[Any]) -> None:
        """Back to vLLM's priority, at the most recently freed end, tail first."""
        if blocks:
            self.retention.retain_freed(blocks, block_hashes, [DEFAULT] * len(blocks), SCOPE)
