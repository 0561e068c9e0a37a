"""Retention directives: validation and the ownership rule.

Semantics follow TensorRT-LLM's KvCacheRetentionConfig and the vLLM retention PR:
token ranges ``[start, end)`` (open end = to the end of the sequence), priority 0-100
(higher is evicted later), optional duration after which the priority reverts to
``DEFAULT_PRIORITY``.

Ownership (one rule, applied atomically by the store on both backends):
- nothing set yet: any caller sets it; a named caller becomes the owner;
- the owner replaces it freely (lower, refresh, clear);
- another scope may only *raise*: its directive is accepted when no token ends up
  with a lower priority than before; the owner stays the owner;
- an anonymous caller (empty scope) lowers and clears nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from google.protobuf import json_format

from sidecar.api.v1 import retention_pb2 as pb
from sidecar.store import Transition, Write
from sidecar.store.base import Rule

DEFAULT_PRIORITY = 35
MIN_PRIORITY, MAX_PRIORITY = 0, 100
MAX_TOKEN_RANGES = 16


class DirectiveError(ValueError):
    """An invalid directive; ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class OwnershipError(Exception):
    """The caller's scope may not make this change."""


def validate(config: pb.RetentionConfig, max_token_ranges: int = MAX_TOKEN_RANGES) -> None:
    ranges = config.token_ranges
    if len(ranges) > max_token_ranges:
        raise DirectiveError("config.token_ranges",
                             f"{len(ranges)} ranges exceed the limit of {max_token_ranges}")
    for index, token_range in enumerate(ranges):
        where = f"config.token_ranges[{index}]"
        if not MIN_PRIORITY <= token_range.priority <= MAX_PRIORITY:
            raise DirectiveError(f"{where}.priority",
                                 f"{token_range.priority} is outside 0-100")
        if token_range.HasField("token_end") and token_range.token_end <= token_range.token_start:
            raise DirectiveError(f"{where}.token_end",
                                 f"{token_range.token_end} must exceed token_start "
                                 f"{token_range.token_start}")
        if token_range.HasField("duration_s") and not (
            math.isfinite(token_range.duration_s) and token_range.duration_s >= 0
        ):
            raise DirectiveError(f"{where}.duration_s", "must be a non-negative number")
    if config.HasField("decode_priority") and not (
        MIN_PRIORITY <= config.decode_priority <= MAX_PRIORITY
    ):
        raise DirectiveError("config.decode_priority", f"{config.decode_priority} is outside 0-100")
    if config.HasField("decode_duration_s") and not (
        math.isfinite(config.decode_duration_s) and config.decode_duration_s >= 0
    ):
        raise DirectiveError("config.decode_duration_s", "must be a non-negative number")
    _check_non_increasing(config)


def _segments(config: pb.RetentionConfig) -> list[tuple[int, float, int]]:
    """(start, end, priority) of each stretch of covered tokens, end = inf for open ranges.
    A token's priority is that of the highest-priority range covering it."""
    bounds: set[float] = set()
    for token_range in config.token_ranges:
        bounds.add(token_range.token_start)
        bounds.add(token_range.token_end if token_range.HasField("token_end") else math.inf)
    points = sorted(bounds)
    segments = []
    for start, end in pairwise(points):
        covering = [
            r.priority for r in config.token_ranges
            if r.token_start <= start and (not r.HasField("token_end") or r.token_end >= end)
        ]
        if covering:
            segments.append((int(start), end, max(covering)))
    return segments


def _check_non_increasing(config: pb.RetentionConfig) -> None:
    # A block is reusable only with its whole prefix: a suffix kept longer than its
    # prefix could never be hit, so priorities must not rise along the sequence.
    previous: int | None = None
    for start, _end, priority in _segments(config):
        if previous is not None and priority > previous:
            raise DirectiveError(
                "config.token_ranges",
                f"priority rises to {priority} at token {start} after {previous}: "
                "a prefix must not be evicted before its suffix",
            )
        previous = priority


def priority_at(config: pb.RetentionConfig, token: int) -> int:
    """Effective priority of one token (DEFAULT_PRIORITY when no range covers it)."""
    covering = [
        r.priority for r in config.token_ranges
        if r.token_start <= token and (not r.HasField("token_end") or token < r.token_end)
    ]
    return max(covering) if covering else DEFAULT_PRIORITY


def only_raises(old: pb.RetentionConfig, new: pb.RetentionConfig) -> bool:
    """True when no token gets a lower priority under ``new`` than under ``old``."""
    probes = {0}
    for config in (old, new):
        for token_range in config.token_ranges:
            probes.add(token_range.token_start)
            if token_range.HasField("token_end"):
                probes.add(token_range.token_end)
                probes.add(max(0, token_range.token_end - 1))
    if any(priority_at(new, token) < priority_at(old, token) for token in probes):
        return False
    old_decode = old.decode_priority if old.HasField("decode_priority") else DEFAULT_PRIORITY
    new_decode = new.decode_priority if new.HasField("decode_priority") else DEFAULT_PRIORITY
    return new_decode >= old_decode


@dataclass(frozen=True, slots=True)
class StoredDirective:
    config: pb.RetentionConfig
    owner_scope: str
    updated_at_unix_s: float

    def encode(self) -> bytes:
        return json.dumps({
            "config": json_format.MessageToDict(self.config),
            "owner_scope": self.owner_scope,
            "updated_at_unix_s": self.updated_at_unix_s,
        }).encode()

    @staticmethod
    def decode(raw: bytes) -> StoredDirective:
        data = json.loads(raw)
        return StoredDirective(
            config=json_format.ParseDict(data["config"], pb.RetentionConfig()),
            owner_scope=data["owner_scope"],
            updated_at_unix_s=data["updated_at_unix_s"],
        )


def set_rule(
    key: str, scope: str, config: pb.RetentionConfig, now_unix_s: float, ttl_ms: int | None
) -> Rule[StoredDirective]:
    """The ownership rule for a Set, as a store transition (see module docstring)."""

    def rule(current: Mapping[str, bytes | None]) -> Transition[StoredDirective]:
        raw = current[key]
        existing = StoredDirective.decode(raw) if raw is not None else None
        if existing is None or (existing.owner_scope and existing.owner_scope == scope) or (
            not existing.owner_scope and scope
        ):
            owner = scope
        elif only_raises(existing.config, config):
            owner = existing.owner_scope
        else:
            raise OwnershipError(
                f"scope {scope or '(anonymous)'!r} may only raise priorities of a directive "
                f"owned by {existing.owner_scope or '(anonymous)'!r}"
            )
        stored = StoredDirective(config=config, owner_scope=owner, updated_at_unix_s=now_unix_s)
        return Transition(result=stored, writes={key: Write(stored.encode(), ttl_ms=ttl_ms)})

    return rule


def clear_rule(key: str, scope: str) -> Rule[bool]:
    """The ownership rule for a Clear: only the owner clears; anonymous clears nothing."""

    def rule(current: Mapping[str, bytes | None]) -> Transition[bool]:
        raw = current[key]
        if raw is None:
            return Transition(result=False)
        existing = StoredDirective.decode(raw)
        if not scope:
            raise OwnershipError("an anonymous caller cannot clear a directive")
        if existing.owner_scope and existing.owner_scope != scope:
            raise OwnershipError(
                f"scope {scope!r} cannot clear a directive owned by {existing.owner_scope!r}"
            )
        return Transition(result=True, writes={key: Write(None)})

    return rule
