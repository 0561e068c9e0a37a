"""The retention priorities the daemon sent per request, applied to its blocks when freed.

The daemon answers a report a step or more after it; a request can finish before
its answer comes. So besides the priorities of live requests, this keeps the
requests reported and not yet answered and, for those that finished meanwhile, the
blocks they freed: their priorities, if the answer carries any, still apply to
whatever of them is still cached. Engine thread only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from sidecar.api.retention_ranges import block_protections
from sidecar.api.v1 import engine_session_pb2 as pb

# Requests reported and not yet answered that are remembered (for retention that
# arrives after a request finished); older ones are forgotten.
MAX_UNANSWERED = 4096


@dataclass(slots=True)
class FreedBlocks:
    """A request's blocks as it freed them: per KV cache group, the block size, the
    blocks and the hash each held (to tell later whether it still holds that content)."""

    prompt_tokens: int
    groups: list[tuple[int, list[Any], list[Any]]]


class RequestRetention:
    """``by_request``: the daemon's retention per live request. ``pool`` is the block
    pool's retention handle (``vllm_plugin.retention``); None: not installed, and
    nothing is applied."""

    def __init__(self, scheduler: Any, pool: Any) -> None:
        self.sched = scheduler
        self.pool = pool
        self.by_request: dict[str, pb.BlockRetention] = {}
        # (seq of the report, request id), oldest first.
        self._unanswered: deque[tuple[int, str]] = deque()
        self._unanswered_ids: set[str] = set()
        self._finished_unanswered: dict[str, FreedBlocks] = {}

    def awaits_word(self, request_id: str) -> bool:
        """Whether the request has retention of its own, set or still to come."""
        return request_id in self.by_request or request_id in self._unanswered_ids

    def reported(self, report: pb.StepReport) -> None:
        """``report`` went out: its new requests await their answer."""
        for new in report.new_requests:
            self._unanswered.append((report.seq, new.request_id))
            self._unanswered_ids.add(new.request_id)
        while len(self._unanswered) > MAX_UNANSWERED:  # a daemon that never answers
            self._forget_oldest()

    def answered(self, seq: int) -> None:
        """The answer to report ``seq`` (and so to every older one) is applied."""
        while self._unanswered and self._unanswered[0][0] <= seq:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        _seq, request_id = self._unanswered.popleft()
        self._unanswered_ids.discard(request_id)
        self._finished_unanswered.pop(request_id, None)

    def reset(self) -> None:
        """A new session (snapshot): answers to the older one never come, and the daemon
        sends the retention again for what it knows."""
        self.by_request.clear()
        self._unanswered.clear()
        self._unanswered_ids.clear()
        self._finished_unanswered.clear()

    def forget(self, request_id: str) -> None:
        self.by_request.pop(request_id, None)

    def set(self, retention: pb.BlockRetention) -> None:
        """The daemon's retention for a request: set, withdrawn, or applied at once to
        what is still cached of a request that finished before the answer came."""
        if not retention.config.token_ranges and not retention.config.HasField(
                "decode_priority"):
            self.by_request.pop(retention.request_id, None)  # withdrawn
        elif retention.request_id in self.sched.requests:
            self.by_request[retention.request_id] = retention
        elif (self.pool is not None and (
                freed := self._finished_unanswered.pop(retention.request_id, None)) is not None):
            # Finished before this answer came (a request shorter than the decision
            # lag): what is still cached of it takes its priorities now.
            for block_size, blocks, hashes in freed.groups:
                protections = block_protections(retention.config, len(blocks), block_size,
                                                freed.prompt_tokens)
                self.pool.retain_freed(blocks, hashes, protections, retention.scope)

    def retain(self, request: Any) -> None:
        """The request's blocks are about to be freed (finish, preemption, pin): give
        them, in the block pool's side table, the priorities the daemon sent for it."""
        if self.pool is None:
            return
        retention = self.by_request.get(request.request_id)
        finished = request.is_finished()
        if retention is None:
            if finished and request.request_id in self._unanswered_ids:
                self._finished_unanswered[request.request_id] = self._freed_blocks(request)
            return
        if finished:
            del self.by_request[request.request_id]
        freed = self._freed_blocks(request)
        for block_size, blocks, _hashes in freed.groups:
            protections = block_protections(retention.config, len(blocks), block_size,
                                            freed.prompt_tokens)
            self.pool.retain(blocks, protections, retention.scope)

    def _freed_blocks(self, request: Any) -> FreedBlocks:
        manager = self.sched.kv_cache_manager
        groups = []
        for group, blocks in enumerate(manager.get_blocks(request.request_id).blocks):
            if blocks:
                groups.append((_block_size(manager, group, default=self.sched.block_size),
                               list(blocks), [block.block_hash for block in blocks]))
        return FreedBlocks(int(request.num_prompt_tokens), groups)


def _block_size(manager: Any, group: int, default: int) -> int:
    """Tokens per block of a KV cache group (vLLM 0.32: the group's spec)."""
    try:
        return int(manager.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size)
    except (AttributeError, IndexError):
        return int(default)
