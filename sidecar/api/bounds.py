"""What a caller may send: one definition of every limit on the wire's strings and numbers.

Both processes check the same rules: the daemon refuses a message that breaks one
(``INVALID_ARGUMENT`` naming the field), and the plugin, which cannot refuse an
inference request, cleans what a client or a model wrote before it reports it.
Standard library only: the plugin imports this inside vLLM's engine process.

Why limits at all: ids and tool names become store keys, metric labels and map keys
that live for hours; an unbounded one is memory any caller can take.
"""

from __future__ import annotations

import math
import re

# Engine, request and job ids, retention scopes and targets.
MAX_ID_CHARS = 256
# Tool names (a program and its subcommand, or a function name).
MAX_TOOL_CHARS = 128
# Page tokens of the Inspect listings: base64 of a position that may hold two ids
# (a pin's engine and request), so about 4/3 x (2 x MAX_ID_CHARS) and some JSON.
MAX_PAGE_TOKEN_CHARS = 1024
# The name under which the statistics of every tool are pooled (the cold-start
# fallback, ``sidecar.store.keys``): no single tool may take it.
ALL_TOOLS = "*"
RESERVED_TOOL_NAMES = frozenset({ALL_TOOLS})

# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators:
# a tool name is one line of text.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
_SPACES = re.compile(r"\s+")


class FieldError(ValueError):
    """A value a caller sent breaks a rule; ``field`` names it (``events[3].at_s``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def check_text(field: str, value: str, max_chars: int = MAX_ID_CHARS, *,
               required: bool = False) -> None:
    """An id or name: at most ``max_chars`` characters, no control characters."""
    if not value:
        if required:
            raise FieldError(field, "must not be empty")
        return
    if len(value) > max_chars:
        raise FieldError(field, f"{len(value)} characters exceed the limit of {max_chars}")
    if _CONTROL.search(value):
        raise FieldError(field, "must not contain control characters")


def check_tool(field: str, value: str) -> None:
    """A tool name as a caller sends it: a bounded line of text, not a reserved name."""
    check_text(field, value, MAX_TOOL_CHARS)
    if value in RESERVED_TOOL_NAMES:
        raise FieldError(field, f"{value!r} is reserved (it names the pool of every tool)")


def check_time(field: str, value: float) -> None:
    """A time or duration in seconds: finite and not negative."""
    if not (math.isfinite(value) and value >= 0.0):
        raise FieldError(field, f"must be a finite number >= 0, got {value!r}")


def clean_tool_name(raw: str) -> str:
    """A tool name read from model output or a client field, made safe to record:
    control characters and runs of white space become one space, the name is cut to
    ``MAX_TOOL_CHARS``, and a reserved name becomes ``""`` (no tool)."""
    name = _SPACES.sub(" ", _CONTROL.sub(" ", raw)).strip()[:MAX_TOOL_CHARS].rstrip()
    return "" if name in RESERVED_TOOL_NAMES else name
