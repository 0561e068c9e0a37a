"""Pages of the Inspect listings: a capped limit and opaque page tokens.

A token is the position after the last item of a page (a job's activity number, a pin's
engine and request id, a tool name), as urlsafe base64 of a JSON list, so a page
picks up where the previous one ended however the listing changed meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from sidecar.api.bounds import FieldError

DEFAULT_PAGE_LIMIT = 100
MAX_PAGE_LIMIT = 1000
# Items an Inspect call handles between two turns of the event loop, so that a step
# report waits for at most one chunk (well under a millisecond of work) behind a
# listing: messages built, or entries of the engines' mirrors scanned.
CHUNK_ITEMS = 100
SCAN_CHUNK_ITEMS = 2000

Item = TypeVar("Item")


def page_limit(limit: int) -> int:
    if limit > MAX_PAGE_LIMIT:
        raise FieldError("limit", f"must be at most {MAX_PAGE_LIMIT}, got {limit}")
    return limit or DEFAULT_PAGE_LIMIT


def encode_token(*position: str | int) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(position)).encode()).decode()


def decode_token(token: str, *types: type) -> list[str | int]:
    """The position a token names, checked against the ``types`` it must hold; raises
    FieldError naming ``page_token`` for one this daemon did not issue."""
    try:
        position = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, binascii.Error, UnicodeError):
        position = None
    if (not isinstance(position, list) or len(position) != len(types)
            or not all(type(value) is kind for value, kind in zip(position, types, strict=True))):
        raise FieldError("page_token", "not a page token of this listing")
    return position


async def in_chunks(items: Sequence[Item]) -> AsyncIterator[Sequence[Item]]:
    """``items`` CHUNK_ITEMS at a time, giving the event loop a turn (engine reports
    waiting on it are answered) before each chunk after the first."""
    for start in range(0, len(items), CHUNK_ITEMS):
        if start:
            await asyncio.sleep(0)
        yield items[start:start + CHUNK_ITEMS]
