"""Retention directives in the store: their encoding and the store transitions that
apply the ownership rule atomically, on both backends (``Store.transact``).

What a directive means lives in :mod:`sidecar.api.retention_ranges` and who may change it
in :mod:`sidecar.api.retention_ownership`; both are re-exported here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from google.protobuf import json_format

from sidecar.api.retention_ownership import OwnershipError, check_clear, check_set
from sidecar.api.retention_ranges import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MAX_TOKEN_RANGES,
    MIN_PRIORITY,
    DirectiveError,
    only_raises,
    priority_at,
    validate,
)
from sidecar.api.v1 import retention_pb2 as pb
from sidecar.store import Transition, Write
from sidecar.store.base import Rule

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MAX_TOKEN_RANGES",
    "MIN_PRIORITY",
    "DirectiveError",
    "OwnershipError",
    "StoredDirective",
    "clear_rule",
    "only_raises",
    "priority_at",
    "set_rule",
    "validate",
]


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
    """The ownership rule (:mod:`sidecar.api.retention_ownership`) for a Set, as a store
    transition: it runs atomically on both backends."""

    def rule(current: Mapping[str, bytes | None]) -> Transition[StoredDirective]:
        raw = current[key]
        existing = StoredDirective.decode(raw) if raw is not None else None
        owner = check_set(
            None if existing is None else existing.owner_scope,
            scope,
            existing is not None and only_raises(existing.config, config),
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
        check_clear(StoredDirective.decode(raw).owner_scope, scope)
        return Transition(result=True, writes={key: Write(None)})

    return rule
