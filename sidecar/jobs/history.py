"""A job's turn events, persisted in the store for inspection and for other daemons.

Each event is one JSON object appended with ``Store.append_capped`` under
``keys.job_history(job_id)``: the list keeps only its newest ``max_events`` items and
expires ``ttl_s`` after its last append, so the store stays bounded however many jobs
pass through (a job that goes quiet disappears by itself; no sweeper).

The JSON format (one object per event; fields absent when empty)::

    {"v": 1, "kind": "arrival" | "finish" | "abort", "job_id": str, "request_id": str,
     "at_s": float, "tool": str, "is_last_step": bool, "tool_time_s": float,
     "prompt_tokens": int, "output_tokens": int}

Token counts came later: events written before them read with ``None``.

Reading skips items it cannot decode (written by a newer version or damaged) rather
than failing an inspection.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal, cast

from sidecar.store import keys
from sidecar.store.base import Store

EventKind = Literal["arrival", "finish", "abort"]
_KINDS: frozenset[str] = frozenset({"arrival", "finish", "abort"})
FORMAT_VERSION = 1
DEFAULT_MAX_EVENTS = 256
DEFAULT_HISTORY_TTL_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class JobEvent:
    kind: EventKind
    job_id: str
    request_id: str
    # Engine time of the arrival, the departure, or the abort.
    at_s: float
    tool: str | None = None
    is_last_step: bool = False
    # On an arrival: the tool time it measured, if any.
    tool_time_s: float | None = None
    # On an arrival: the prompt's tokens; on a finish or an abort: the tokens generated.
    prompt_tokens: int | None = None
    output_tokens: int | None = None

    def to_json(self) -> bytes:
        item: dict[str, object] = {
            "v": FORMAT_VERSION,
            "kind": self.kind,
            "job_id": self.job_id,
            "request_id": self.request_id,
            "at_s": self.at_s,
        }
        if self.tool is not None:
            item["tool"] = self.tool
        if self.is_last_step:
            item["is_last_step"] = True
        if self.tool_time_s is not None:
            item["tool_time_s"] = self.tool_time_s
        if self.prompt_tokens is not None:
            item["prompt_tokens"] = self.prompt_tokens
        if self.output_tokens is not None:
            item["output_tokens"] = self.output_tokens
        return json.dumps(item, separators=(",", ":")).encode()

    @staticmethod
    def from_json(raw: bytes) -> JobEvent | None:
        """The event an item holds, or None if it is not one this version can read."""
        try:
            item = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(item, dict) or item.get("v") != FORMAT_VERSION:
            return None
        kind, job_id, request_id = item.get("kind"), item.get("job_id"), item.get("request_id")
        at_s, tool, tool_time_s = item.get("at_s"), item.get("tool"), item.get("tool_time_s")
        prompt_tokens, output_tokens = item.get("prompt_tokens"), item.get("output_tokens")
        if (
            kind not in _KINDS
            or not isinstance(job_id, str)
            or not isinstance(request_id, str)
            or not isinstance(at_s, int | float)
            or not _is_number(at_s)
            or not (tool is None or isinstance(tool, str))
            or not (tool_time_s is None or _is_number(tool_time_s))
            or not (prompt_tokens is None or _is_count(prompt_tokens))
            or not (output_tokens is None or _is_count(output_tokens))
        ):
            return None
        return JobEvent(
            kind=cast(EventKind, kind),
            job_id=job_id,
            request_id=request_id,
            at_s=float(at_s),
            tool=tool,
            is_last_step=item.get("is_last_step") is True,
            tool_time_s=None if tool_time_s is None else float(tool_time_s),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
        )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class JobHistoryLog:
    """Appends and reads job events in the store. Safe to share between coroutines."""

    def __init__(
        self,
        store: Store,
        *,
        max_events: int = DEFAULT_MAX_EVENTS,
        ttl_s: float = DEFAULT_HISTORY_TTL_S,
    ) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events!r}")
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"ttl_s must be a positive number, got {ttl_s!r}")
        self._store = store
        self.max_events = max_events
        self._ttl_ms = int(ttl_s * 1000)

    async def append(self, event: JobEvent) -> None:
        await self._store.append_capped(
            keys.job_history(event.job_id), event.to_json(), self.max_events, self._ttl_ms
        )

    async def read(self, job_id: str) -> list[JobEvent]:
        return await read_job_history(self._store, job_id)


async def read_job_history(store: Store, job_id: str) -> list[JobEvent]:
    """A job's persisted events, oldest first; [] for an unknown or expired job."""
    events = []
    for raw in await store.list_items(keys.job_history(job_id)):
        event = JobEvent.from_json(raw)
        if event is not None:
            events.append(event)
    return events
