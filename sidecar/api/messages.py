"""The rules every field of every request message obeys, whatever its meaning: checked
by walking the message's descriptor, so a field added to a .proto is covered at once.

- a float or double is finite (``NaN`` and ``inf`` mean nothing as a time, a duration
  or a count, and poison every sum they enter);
- an enum holds a value its enum defines (proto3 keeps unknown numbers as they came);
- a string is an id or a name (:func:`sidecar.api.bounds.check_text`): at most
  ``MAX_ID_CHARS`` characters, ``MAX_TOOL_CHARS`` for a tool name, no control
  characters.

What a field means (a time not negative, a required id, a reserved tool name) is the
service's own check, after this one. Raises :class:`~sidecar.api.bounds.FieldError`
naming the field as the caller wrote it (``events[3].at_s``).

It runs on the decision path for every step report: each message type's fields are
sorted by kind once (:class:`_Plan`), and a message is read field by field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from sidecar.api.bounds import MAX_ID_CHARS, MAX_TOOL_CHARS, FieldError, check_text

# Fields holding a tool name; every other string holds an id, a scope or a target.
TOOL_FIELDS = frozenset({"tool", "tool_hint"})

_FLOATS = frozenset({FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT})


def check_message(message: Message, skip: Iterable[str] = ()) -> None:
    """Check every field set in ``message`` and in the messages it holds; ``skip``
    names fields (as paths without indexes, ``new_requests.retention``) left to
    their service's own checks."""
    _plan(cast(Descriptor, message.DESCRIPTOR), frozenset(skip)).check(message)


@dataclass(slots=True)
class _Plan:
    """One message type's checked fields, by kind. A failing field is named relative
    to the message; each enclosing message adds its own part on the way out, so that
    nothing is formatted while the fields are good."""

    floats: list[str] = field(default_factory=list)
    enums: list[FieldDescriptor] = field(default_factory=list)
    strings: list[tuple[str, int]] = field(default_factory=list)
    repeated_scalars: list[FieldDescriptor] = field(default_factory=list)
    messages: list[tuple[str, _Plan]] = field(default_factory=list)
    repeated_messages: list[tuple[str, _Plan]] = field(default_factory=list)
    maps: list[FieldDescriptor] = field(default_factory=list)

    def check(self, message: Message) -> None:
        for name in self.floats:
            value = getattr(message, name)
            if not math.isfinite(value):
                raise FieldError(name, f"must be a finite number, got {value!r}")
        for enum_field in self.enums:
            _check_scalar(enum_field, enum_field.name, getattr(message, enum_field.name))
        for name, limit in self.strings:
            value = getattr(message, name)
            if len(value) > limit or not value.isprintable():
                check_text(name, value, limit)
        for scalar in self.repeated_scalars:
            for index, value in enumerate(getattr(message, scalar.name)):
                _check_scalar(scalar, f"{scalar.name}[{index}]", value)
        for name, plan in self.messages:
            if message.HasField(name):
                try:
                    plan.check(getattr(message, name))
                except FieldError as error:
                    raise FieldError(f"{name}.{error.field}", error.problem) from None
        for name, plan in self.repeated_messages:
            for index, item in enumerate(getattr(message, name)):
                try:
                    plan.check(item)
                except FieldError as error:
                    raise FieldError(f"{name}[{index}].{error.field}", error.problem) from None
        for map_field in self.maps:
            entry = _message_type(map_field).fields_by_name
            key_field, value_field = entry["key"], entry["value"]
            for key, value in getattr(message, map_field.name).items():
                where = f"{map_field.name}[{key!r:.40}]"
                _check_scalar(key_field, where, key)
                if value_field.type != FieldDescriptor.TYPE_MESSAGE:
                    _check_scalar(value_field, where, value)
                    continue
                try:
                    _plan(_message_type(value_field), frozenset()).check(value)
                except FieldError as error:
                    raise FieldError(f"{where}.{error.field}", error.problem) from None


def _check_scalar(scalar: FieldDescriptor, where: str, value: object) -> None:
    if scalar.type in _FLOATS:
        assert isinstance(value, float)
        if not math.isfinite(value):
            raise FieldError(where, f"must be a finite number, got {value!r}")
    elif scalar.type == FieldDescriptor.TYPE_ENUM:
        enum_type = scalar.enum_type
        assert enum_type is not None
        if value not in enum_type.values_by_number:
            defined = ", ".join(v.name for v in enum_type.values)
            raise FieldError(where, f"{value!r} is not a {enum_type.name} ({defined})")
    elif scalar.type == FieldDescriptor.TYPE_STRING:
        assert isinstance(value, str)
        check_text(where, value, _string_limit(scalar))


def _message_type(holder: FieldDescriptor) -> Descriptor:
    message_type = holder.message_type
    assert message_type is not None
    return message_type


def _string_limit(string: FieldDescriptor) -> int:
    return MAX_TOOL_CHARS if string.name in TOOL_FIELDS else MAX_ID_CHARS


_PLANS: dict[tuple[str, frozenset[str], str], _Plan] = {}


def _plan(descriptor: Descriptor, skip: frozenset[str], prefix: str = "") -> _Plan:
    key = (descriptor.full_name, skip, prefix)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    plan = _PLANS[key] = _Plan()
    for item in descriptor.fields:
        if f"{prefix}{item.name}" in skip:
            continue
        if item.type == FieldDescriptor.TYPE_MESSAGE:
            if _message_type(item).GetOptions().map_entry:
                plan.maps.append(item)
                continue
            sub = _plan(_message_type(item), skip, f"{prefix}{item.name}.")
            (plan.repeated_messages if item.is_repeated else plan.messages).append(
                (item.name, sub))
        elif item.type not in _FLOATS | {FieldDescriptor.TYPE_ENUM, FieldDescriptor.TYPE_STRING}:
            continue
        elif item.is_repeated:
            plan.repeated_scalars.append(item)
        elif item.type in _FLOATS:
            plan.floats.append(item.name)
        elif item.type == FieldDescriptor.TYPE_ENUM:
            plan.enums.append(item)
        else:
            plan.strings.append((item.name, _string_limit(item)))
    return plan
