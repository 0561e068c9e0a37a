"""The ownership rule for retention directives — one implementation, used by the store
transitions (``sidecar.retention.directives``, per job or session) and by the engine's
block table (``vllm_plugin.retention``, per KV block).

- nothing set yet: any caller sets it; a named caller becomes the owner;
- the owner replaces it freely (lower, refresh, clear); a named caller may also claim
  what an anonymous caller set;
- any other caller may only *raise* (nothing ends up less protected at any moment);
  the owner stays the owner;
- an anonymous caller (empty scope) lowers, refreshes and clears nothing.

Pure: no I/O, no store, no gRPC.
"""

from __future__ import annotations

ANONYMOUS = ""


class OwnershipError(Exception):
    """The caller's scope may not make this change; ``owner`` is the directive's owner
    (``ANONYMOUS`` when nobody owns it)."""

    def __init__(self, message: str, owner: str) -> None:
        super().__init__(message)
        self.owner = owner


def owner_after_set(current_owner: str | None, caller: str, only_raises: bool) -> str | None:
    """The owner after ``caller`` replaces what ``current_owner`` set (None: nothing
    set), or None when the change is refused. ``only_raises``: the change protects
    nothing less than before."""
    if current_owner is None:
        return caller
    if caller != ANONYMOUS and (caller == current_owner or current_owner == ANONYMOUS):
        return caller
    if only_raises:
        return current_owner
    return None


def check_set(current_owner: str | None, caller: str, only_raises: bool) -> str:
    """:func:`owner_after_set`, raising OwnershipError when refused."""
    owner = owner_after_set(current_owner, caller, only_raises)
    if owner is None:
        raise OwnershipError(
            f"scope {caller or '(anonymous)'!r} may only raise priorities of a directive "
            f"owned by {current_owner or '(anonymous)'!r}",
            current_owner or ANONYMOUS,
        )
    return owner


def check_clear(current_owner: str, caller: str) -> None:
    """Raise OwnershipError unless ``caller`` may clear what ``current_owner`` set."""
    if caller == ANONYMOUS:
        raise OwnershipError("an anonymous caller cannot clear a directive", current_owner)
    if current_owner != ANONYMOUS and current_owner != caller:
        raise OwnershipError(
            f"scope {caller!r} cannot clear a directive owned by {current_owner!r}",
            current_owner,
        )
