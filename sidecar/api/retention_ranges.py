"""What a retention config means, token by token and block by block (pure; no I/O).

Semantics follow TensorRT-LLM's ``KvCacheRetentionConfig`` and the vLLM retention PR:
- a token range ``[token_start, token_end)`` (no end = to the end of the sequence)
  gives its tokens a priority 0-100 (higher is evicted later) and optionally a
  duration in seconds, counted from when a block becomes reusable (freed), after
  which its priority reverts to ``DEFAULT_PRIORITY``;
- where ranges overlap, the strongest wins: the highest priority, then the longest
  duration (none = forever);
- a block's protection is the strongest of the ranges overlapping its tokens; blocks
  holding decode tokens (past the prompt) take ``decode_priority`` /
  ``decode_duration_s`` when set, else the ranges that reach them;
- tokens no range covers have no directive: they count as the default (35, forever)
  when compared, and are left out when configs are merged.

Shared by the daemon (validation, ownership, merging) and the engine plugin (block
priorities, vllm_xargs parsing): one implementation of each rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from sidecar.api.v1 import retention_pb2 as pb

DEFAULT_PRIORITY = 35
MIN_PRIORITY, MAX_PRIORITY = 0, 100
MAX_TOKEN_RANGES = 16
# Largest token index the wire carries (uint32).
MAX_TOKEN = 2**32 - 1


class DirectiveError(ValueError):
    """An invalid directive; ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Protection:
    """A priority and how long it lasts once the block is free (None = forever)."""

    priority: int
    duration_s: float | None = None

    def at(self, freed_for_s: float) -> int:
        """The priority ``freed_for_s`` seconds after the block became reusable."""
        if self.duration_s is None or freed_for_s < self.duration_s:
            return self.priority
        return DEFAULT_PRIORITY

    @property
    def strength(self) -> tuple[int, float]:
        return (self.priority, math.inf if self.duration_s is None else self.duration_s)

    @property
    def is_default(self) -> bool:
        """Indistinguishable from having no directive at all."""
        return self.priority == DEFAULT_PRIORITY or self.duration_s == 0


DEFAULT = Protection(DEFAULT_PRIORITY)


def dominates(new: Protection, old: Protection) -> bool:
    """True when ``new`` is at least ``old`` at every moment after the block is freed:
    a raise, never a lowering, shortening or early expiry. Both are piecewise constant
    and change only at their durations, so those instants are all that need checking."""
    instants = [0.0]
    instants.extend(p.duration_s for p in (new, old) if p.duration_s is not None)
    return all(new.at(t) >= old.at(t) for t in instants)


def _range_protection(token_range: pb.TokenRangeRetention) -> Protection:
    return Protection(
        token_range.priority,
        token_range.duration_s if token_range.HasField("duration_s") else None,
    )


def _end(token_range: pb.TokenRangeRetention) -> float:
    return token_range.token_end if token_range.HasField("token_end") else math.inf


def _strongest(protections: Iterable[Protection]) -> Protection | None:
    return max(protections, key=lambda p: p.strength, default=None)


def decode_protection(config: pb.RetentionConfig) -> Protection | None:
    if not config.HasField("decode_priority"):
        return None
    return Protection(
        config.decode_priority,
        config.decode_duration_s if config.HasField("decode_duration_s") else None,
    )


def segments(config: pb.RetentionConfig) -> list[tuple[int, float, Protection]]:
    """``(start, end, protection)`` of each stretch of covered tokens, in order;
    ``end`` is ``inf`` for a stretch that runs to the end of the sequence."""
    bounds: set[float] = set()
    for token_range in config.token_ranges:
        bounds.add(token_range.token_start)
        bounds.add(_end(token_range))
    found = []
    for start, end in pairwise(sorted(bounds)):
        strongest = _strongest(
            _range_protection(r) for r in config.token_ranges
            if r.token_start <= start and _end(r) >= end
        )
        if strongest is not None:
            found.append((int(start), end, strongest))
    return found


def protection_at(config: pb.RetentionConfig, token: int) -> Protection | None:
    """The protection of one token; None when no range covers it."""
    return _strongest(
        _range_protection(r) for r in config.token_ranges
        if r.token_start <= token < _end(r)
    )


def priority_at(config: pb.RetentionConfig, token: int) -> int:
    """Effective priority of one token (DEFAULT_PRIORITY when no range covers it)."""
    protection = protection_at(config, token)
    return DEFAULT_PRIORITY if protection is None else protection.priority


def validate(config: pb.RetentionConfig, max_token_ranges: int = MAX_TOKEN_RANGES) -> None:
    """Raise DirectiveError naming the first bad field."""
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


def _check_non_increasing(config: pb.RetentionConfig) -> None:
    # A block is reusable only with its whole prefix: a suffix kept longer than its
    # prefix could never be hit, so priorities must not rise along the sequence.
    previous: Protection | None = None
    stretches = segments(config)
    for start, _end_token, protection in stretches:
        if previous is not None and protection.priority > previous.priority:
            raise DirectiveError(
                "config.token_ranges",
                f"priority rises to {protection.priority} at token {start} after "
                f"{previous.priority}: a prefix must not be evicted before its suffix",
            )
        previous = protection
    decode = decode_protection(config)
    # Decode tokens follow every prompt token; when an open range reaches the end of
    # any prompt, decode tokens must not outrank it.
    if decode is not None and stretches and math.isinf(stretches[-1][1]):
        last = stretches[-1][2]
        if decode.priority > last.priority:
            raise DirectiveError(
                "config.decode_priority",
                f"{decode.priority} exceeds {last.priority}, the priority of the open range "
                "before it: a prefix must not be evicted before its suffix",
            )


def only_raises(old: pb.RetentionConfig, new: pb.RetentionConfig) -> bool:
    """True when no token (nor decode) is less protected under ``new`` than under
    ``old`` at any moment: what a scope that does not own ``old`` may do."""
    probes = {0}
    for config in (old, new):
        for token_range in config.token_ranges:
            probes.add(token_range.token_start)
            if token_range.HasField("token_end"):
                probes.add(token_range.token_end)
    for token in probes:
        if not dominates(protection_at(new, token) or DEFAULT,
                         protection_at(old, token) or DEFAULT):
            return False
    return dominates(decode_protection(new) or DEFAULT, decode_protection(old) or DEFAULT)


def merge(configs: Sequence[pb.RetentionConfig]) -> pb.RetentionConfig:
    """Token by token, the strongest protection any config gives (uncovered tokens
    stay uncovered); decode likewise. One config comes back as an equal copy."""
    merged = pb.RetentionConfig()
    if len(configs) == 1:
        merged.CopyFrom(configs[0])
        return merged
    bounds: set[float] = set()
    for config in configs:
        for token_range in config.token_ranges:
            bounds.add(token_range.token_start)
            bounds.add(_end(token_range))
    previous: pb.TokenRangeRetention | None = None
    for start, end in pairwise(sorted(bounds)):
        strongest = _strongest(
            p for p in (protection_at(c, int(start)) for c in configs) if p is not None)
        if strongest is None:
            previous = None
            continue
        if previous is not None and _range_protection(previous) == strongest:
            _set_end(previous, end)  # extend the stretch before: same protection
            continue
        previous = merged.token_ranges.add(token_start=int(start), priority=strongest.priority)
        _set_end(previous, end)
        if strongest.duration_s is not None:
            previous.duration_s = strongest.duration_s
    decode = _strongest(p for p in map(decode_protection, configs) if p is not None)
    if decode is not None:
        merged.decode_priority = decode.priority
        if decode.duration_s is not None:
            merged.decode_duration_s = decode.duration_s
    return merged


def _set_end(token_range: pb.TokenRangeRetention, end: float) -> None:
    if math.isinf(end):
        token_range.ClearField("token_end")
    else:
        token_range.token_end = int(end)


def block_protections(
    config: pb.RetentionConfig, num_blocks: int, block_size: int, prompt_tokens: int
) -> list[Protection]:
    """The protection of each of a request's first ``num_blocks`` blocks of
    ``block_size`` tokens (DEFAULT where nothing applies)."""
    ranges = [(r.token_start, _end(r), _range_protection(r)) for r in config.token_ranges]
    decode = decode_protection(config)
    found = []
    for index in range(num_blocks):
        low, high = index * block_size, (index + 1) * block_size
        # Ranges reach decode tokens too unless the config names a decode priority.
        reach = high if decode is None else min(high, prompt_tokens)
        candidates = [p for start, end, p in ranges if start < reach and end > low
                      and low < reach]
        if decode is not None and high > prompt_tokens:
            candidates.append(decode)
        found.append(_strongest(candidates) or DEFAULT)
    return found


# --- the per-request shape (vllm_xargs "retention_directives", the PR's chat field) ---
_KEYS = {
    "start": "token_start", "token_start": "token_start",
    "end": "token_end", "token_end": "token_end",
    "priority": "priority",
    "duration": "duration_s", "duration_s": "duration_s",
}


def from_request_directives(items: Sequence[Mapping[str, Any]]) -> pb.RetentionConfig:
    """The PR's / TensorRT-LLM's JSON shape — ``[{"start": 0, "end": 512,
    "priority": 100, "duration": 45.0}, ...]`` (``token_start`` / ``token_end`` /
    ``duration_s`` also accepted; no ``end`` = open) — as a RetentionConfig.

    Checks only what the wire cannot carry (types, signs, unknown keys); the daemon
    validates the meaning (:func:`validate`). Raises DirectiveError naming the field.
    """
    config = pb.RetentionConfig()
    for index, item in enumerate(items):
        where = f"retention_directives[{index}]"
        unknown = sorted(set(item) - set(_KEYS))
        if unknown:
            raise DirectiveError(f"{where}.{unknown[0]}", "unknown field")
        fields = {_KEYS[key]: value for key, value in item.items() if value is not None}
        if "priority" not in fields:
            raise DirectiveError(f"{where}.priority", "is required")
        token_range = config.token_ranges.add()
        for name in ("token_start", "token_end", "priority"):
            if name not in fields:
                continue  # token_start 0, token_end open
            value = fields[name]
            if isinstance(value, bool) or not isinstance(value, int) or not (
                0 <= value <= MAX_TOKEN
            ):
                raise DirectiveError(f"{where}.{name}",
                                     f"expected a non-negative integer, got {value!r}")
            setattr(token_range, name, value)
        if "duration_s" in fields:
            duration = fields["duration_s"]
            if isinstance(duration, bool) or not isinstance(duration, int | float):
                raise DirectiveError(f"{where}.duration", f"expected seconds, got {duration!r}")
            try:
                token_range.duration_s = float(duration)
            except OverflowError:  # an integer beyond any float
                raise DirectiveError(f"{where}.duration", "too large") from None
    return config
