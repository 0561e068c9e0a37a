"""Authenticated scopes: a bearer token (gRPC metadata ``authorization: Bearer
<token>``) maps to the one scope it may act as.

With tokens configured (``auth.tokens`` / ``auth.tokens_file``), a retention mutation's
scope is the token's, whatever the request claims, and a mutation without a valid token
is refused (UNAUTHENTICATED); an engine reports steps only with a token of one of the
``engine_scopes`` (else UNAUTHENTICATED, or PERMISSION_DENIED for another scope's),
and only for the engine ids its scope's ``engine_ids`` patterns match (any id where
the scope has none); reading (Inspect, Retention/GetDirectives) takes a token of one of
the ``read_scopes`` (any scope where none are listed). Without tokens, scopes are
whatever callers claim, and engines and readers need none; the daemon says so in a
warning at start-up.

Tokens are kept only as SHA-256 digests, and looked up by digest: how long a lookup
takes says nothing about how close a guess was.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterable, Mapping

AUTHORIZATION = "authorization"
_SCHEME = "bearer"


class Unauthenticated(Exception):
    """No valid bearer token; the message says what was wrong (never the token)."""


class NotAnEngineScope(Exception):
    """A valid token whose scope may not report engine steps (or not for that engine)."""


class NotAReadScope(Exception):
    """A valid token whose scope may not read (``auth.read_scopes``)."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    def __init__(self, token_scopes: Mapping[str, str], engine_scopes: Iterable[str] = (),
                 engine_ids: Mapping[str, Iterable[str]] | None = None,
                 read_scopes: Iterable[str] = ()) -> None:
        self._scope_by_digest = {_digest(token): scope for token, scope in token_scopes.items()}
        self._engine_scopes = frozenset(engine_scopes)
        # Engine scope -> fnmatch patterns of the engine ids it may report for.
        self._engine_ids = {scope: tuple(patterns)
                            for scope, patterns in (engine_ids or {}).items()}
        self._read_scopes = frozenset(read_scopes)

    @property
    def enabled(self) -> bool:
        return bool(self._scope_by_digest)

    @property
    def scopes(self) -> list[str]:
        return sorted(set(self._scope_by_digest.values()))

    def scope_of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The scope the caller's token authenticates. Raises Unauthenticated."""
        values = [value for key, value in metadata or () if key.lower() == AUTHORIZATION]
        if not values:
            raise Unauthenticated(
                "authorization: missing; send gRPC metadata 'authorization: Bearer <token>'")
        if len(values) > 1:
            raise Unauthenticated("authorization: sent more than once")
        value = values[0]
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != _SCHEME or not token:
            raise Unauthenticated("authorization: expected 'Bearer <token>'")
        scope = self._scope_by_digest.get(_digest(token))
        if scope is None:
            raise Unauthenticated("authorization: unknown token")
        return scope

    def engine_scope_of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The engine scope the caller's token authenticates. Raises Unauthenticated, or
        NotAnEngineScope for a token of another scope."""
        scope = self.scope_of(metadata)
        if scope not in self._engine_scopes:
            raise NotAnEngineScope(f"scope {scope!r} may not report engine steps: "
                                   f"auth.engine_scopes lists {sorted(self._engine_scopes)}")
        return scope

    def check_engine_id(self, scope: str, engine_id: str) -> None:
        """Raise NotAnEngineScope unless ``scope`` may report for ``engine_id``."""
        patterns = self._engine_ids.get(scope)
        if patterns is None or any(fnmatch.fnmatchcase(engine_id, pattern)
                                   for pattern in patterns):
            return
        raise NotAnEngineScope(f"engine_id: scope {scope!r} may not report for engine "
                               f"{engine_id[:64]!r}: auth.engine_ids gives it {list(patterns)}")

    def read_scope_of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The scope the caller's token authenticates, one that may read. Raises
        Unauthenticated, or NotAReadScope for a token of another scope."""
        scope = self.scope_of(metadata)
        if self._read_scopes and scope not in self._read_scopes:
            raise NotAReadScope(f"scope {scope!r} may not read: auth.read_scopes lists "
                                f"{sorted(self._read_scopes)}")
        return scope
