"""The rules every field of every request message obeys, whatever its meaning: checked
from the message's descriptor, so a field added to a .proto is covered at once.

- a float or double is finite (``NaN`` and ``inf`` mean nothing as a time, a duration
  or a count, and poison every sum they enter);
- an enum holds a value its enum defines (proto3 keeps unknown numbers as they came);
- a string is an id or a name (:func:`sidecar.api.bounds.check_text`): at most
  ``MAX_ID_CHARS`` characters, ``MAX_TOOL_CHARS`` for a tool name and
  ``MAX_PAGE_TOKEN_CHARS`` for a page token, no control characters.

What a field means (a time not negative, a required id, a reserved tool name) is the
service's own check, after this one. Raises :class:`~sidecar.api.bounds.FieldError`
naming the field as the caller wrote it (``events[3].at_s``).

It runs on the decision path for every step report, so each message type's checks are
compiled once into a function that reads just the fields that need one, in straight
lines (as ``dataclasses`` builds ``__init__``): walking the descriptor at every call
cost several times more. A failing field is named relative to its message; each
enclosing message adds its part on the way out, so nothing is formatted while the
fields are good.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable
from typing import Any, cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from sidecar.api.bounds import (
    MAX_ID_CHARS,
    MAX_PAGE_TOKEN_CHARS,
    MAX_TOOL_CHARS,
    FieldError,
    check_text,
)

# Fields holding a tool name or a page token; every other string holds an id, a scope
# or a target.
TOOL_FIELDS = frozenset({"tool", "tool_hint"})
PAGE_TOKEN_FIELDS = frozenset({"page_token"})

_FLOATS = frozenset({FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT})

Checker = Callable[[Message], None]


def check_message(message: Message, skip: frozenset[str] = frozenset()) -> None:
    """Check every field set in ``message`` and in the messages it holds; ``skip``
    names fields (as paths without indexes, ``new_requests.retention``) left to
    their service's own checks."""
    checker = _BY_TYPE.get((type(message), skip))
    if checker is None:
        checker = _checker(cast(Descriptor, message.DESCRIPTOR), skip, "")
        _BY_TYPE[(type(message), skip)] = checker
    checker(message)


_BY_TYPE: dict[tuple[type[Message], frozenset[str]], Checker] = {}


def _not_finite(field: str, value: float) -> None:
    raise FieldError(field, f"must be a finite number, got {value!r}")


def _not_defined(field: str, value: int, enum_field: FieldDescriptor) -> None:
    enum_type = enum_field.enum_type
    assert enum_type is not None
    defined = ", ".join(v.name for v in enum_type.values)
    raise FieldError(field, f"{value!r} is not a {enum_type.name} ({defined})")


def _within(field: str, error: FieldError) -> None:
    raise FieldError(f"{field}{error.field}", error.problem) from None


def _checker(descriptor: Descriptor, skip: frozenset[str], prefix: str) -> Checker:
    """The compiled checks of one message type (at ``prefix`` in the request, which
    ``skip`` is matched against)."""
    names: dict[str, Any] = {
        "isfinite": math.isfinite, "check_text": check_text, "FieldError": FieldError,
        "not_finite": _not_finite, "not_defined": _not_defined, "within": _within}
    lines: list[str] = []
    for item in descriptor.fields:
        name = item.name
        if f"{prefix}{name}" in skip:
            continue
        # Field names are proto identifiers; one that is a Python keyword is read by name.
        read = f'getattr(m, "{name}")' if keyword.iskeyword(name) else f"m.{name}"
        message_type = item.message_type
        if message_type is not None and message_type.GetOptions().map_entry:
            key_field, value_field = (message_type.fields_by_name[part]
                                      for part in ("key", "value"))
            where = f'f"{name}[{{k!r:.40}}]"'
            body = _scalar_lines(key_field, "k", where, names)
            if value_field.message_type is None:
                body += _scalar_lines(value_field, "v", where, names)
            else:
                body += _message_lines(value_field, skip, f"{prefix}{name}.", where, names)
            head, indent = [f"for k, v in {read}.items():"], "    "
        else:
            repeated = _is_repeated(item)
            where = f'f"{name}[{{i}}]"' if repeated else f'"{name}"'
            if message_type is None:
                body = _scalar_lines(item, "v", where, names)
            else:
                body = _message_lines(item, skip, f"{prefix}{name}.", where, names)
            if repeated:
                head, indent = [f"for i, v in enumerate({read}):"], "    "
            elif message_type is not None:
                head, indent = [f'if m.HasField("{name}"):', f"    v = {read}"], "    "
            else:
                head, indent = [f"v = {read}"], ""
        if body:
            lines += head + [indent + line for line in body]
    if not lines:
        return _nothing
    source = "def check(m):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile(source, f"<checks of {descriptor.full_name}>", "exec"), names)
    return cast(Checker, names["check"])


def _is_repeated(item: FieldDescriptor) -> bool:
    # protobuf 7 has only ``is_repeated``; 5.29 only ``label`` (both are supported).
    repeated = getattr(item, "is_repeated", None)
    if repeated is None:
        return bool(getattr(item, "label") == FieldDescriptor.LABEL_REPEATED)  # noqa: B009
    return bool(repeated)


def _scalar_lines(item: FieldDescriptor, value: str, where: str, names: dict[str, Any]
                  ) -> list[str]:
    """Lines checking the scalar ``value`` of field ``item``, named ``where`` if bad."""
    if item.type in _FLOATS:
        return [f"if not isfinite({value}):", f"    not_finite({where}, {value})"]
    if item.type == FieldDescriptor.TYPE_ENUM:
        enum_type = item.enum_type
        assert enum_type is not None
        defined, field = _bind(names, frozenset(enum_type.values_by_number)), _bind(names, item)
        return [f"if {value} not in {defined}:",
                f"    not_defined({where}, {value}, {field})"]
    if item.type == FieldDescriptor.TYPE_STRING:
        limit = (MAX_TOOL_CHARS if item.name in TOOL_FIELDS
                 else MAX_PAGE_TOKEN_CHARS if item.name in PAGE_TOKEN_FIELDS
                 else MAX_ID_CHARS)
        return [f"if len({value}) > {limit} or not {value}.isprintable():",
                f"    check_text({where}, {value}, {limit})"]
    return []


def _message_lines(item: FieldDescriptor, skip: frozenset[str], prefix: str, where: str,
                   names: dict[str, Any]) -> list[str]:
    """Lines checking the message ``v`` of field ``item`` with its type's checks."""
    message_type = item.message_type
    assert message_type is not None
    checker = _checker(message_type, skip, prefix)
    if checker is _nothing:
        return []
    return ["try:", f"    {_bind(names, checker)}(v)", "except FieldError as error:",
            f'    within({where} + ".", error)']


def _bind(names: dict[str, Any], value: object) -> str:
    """A new name for ``value`` in the compiled function's globals."""
    name = f"bound_{len(names)}"
    names[name] = value
    return name


def _nothing(message: Message) -> None:
    """The checks of a message type with no field to check."""
