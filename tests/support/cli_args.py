"""Reading and rewriting the daemon command lines deployment files carry."""

from __future__ import annotations


def flag_value(args: list[str], flag: str, default: str | None = None) -> str | None:
    for index, arg in enumerate(args):
        if arg == flag:
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """args with flag's value replaced (the flag must be there)."""
    out = list(args)
    for index, arg in enumerate(out):
        if arg == flag:
            out[index + 1] = value
            return out
        if arg.startswith(flag + "="):
            out[index] = f"{flag}={value}"
            return out
    raise AssertionError(f"{flag} missing from {args}")
