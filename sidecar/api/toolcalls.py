"""Which tool did a finished turn call? Pure parsing of the model's output.

The engine calls :func:`resolve_tool` once per finished request (after vLLM's own tool
parser, when ``KVTETHER_PLUGIN_TOOL_PARSER`` names one and it found no call; that
parser's calls are keyed by :func:`call_key`); the name it returns keys the tool-time
statistics and ContextServe's FAST / SLOW tables, so the same normalisation
(:func:`command_key`) serves both.

Rules, in order:

1. A tool named by the client or an orchestrator wins.
2. ``<think>…</think>`` reasoning is removed first: thinking models (Qwen3, DeepSeek-R1)
   draft commands while reasoning, and a draft is not the call (Continuum's parser
   read 2/10 turns right on such output because of this).
3. Of the tool calls in what remains, the one that appears *last* wins: an agent's
   action ends its turn. Tool calls are
   - fenced shell blocks (```` ```bash ````, ``sh``, ``shell``, ``zsh``, ``console``): the
     first meaningful command of the last block, as its :func:`command_key`;
   - Hermes-style ``<tool_call>{…}</tool_call>``, also one cut off by ``max_tokens``
     (``<tool_call>{"name": "x", "arguments": {…``) once its name is complete;
   - JSON tool calls, OpenAI style ``{"name": …, "arguments": …}``,
     ``{"function": {"name": …}}`` or a message with ``"tool_calls": […]`` (its last).
   A JSON call of a shell tool (``bash``, ``execute_bash``, …) whose arguments carry a
   ``command`` is keyed by that command, so it shares statistics with fenced blocks.
4. Plain text: no tool (``None``).

Every name, the client's or one parsed, is cleaned the same way
(:func:`~sidecar.api.bounds.clean_tool_name`): one line without control characters, at
most ``MAX_TOOL_CHARS``; the reserved pool name ``*`` is no tool.

Contract: never raises on any input; linear in the output length (only the last
``TAIL_CHARS`` characters after stripping thinking are searched).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from typing import Any

from sidecar.api.bounds import clean_tool_name

# Only the end of an output can hold the call that ends the turn; bounding the
# search keeps parsing cheap on very long outputs.
TAIL_CHARS = 32_768

# Commands whose key is two words ("git status", "pip install"): their subcommand,
# not the program, says how long they take.
SUBCOMMAND_PROGRAMS = frozenset(
    {
        "apt",
        "apt-get",
        "brew",
        "cargo",
        "conda",
        "docker",
        "dotnet",
        "git",
        "go",
        "helm",
        "kubectl",
        "npm",
        "pip",
        "pnpm",
        "poetry",
        "uv",
        "yarn",
    }
)
# Wrappers that run the command after them (and, for these, take no value first).
_WRAPPERS = frozenset({"sudo", "env", "time", "nohup", "exec", "command", "nice", "stdbuf"})
_WRAPPER_VALUE_OPTIONS = frozenset({"-u", "-g", "-n", "-C", "-o", "-e"})
# Set-up steps that take no time and say nothing about the tool: skipped when they
# start a chain like ``cd /repo && pytest``.
_SETUP_COMMANDS = frozenset({"cd", "pushd", "export", "source", ".", "set", "unset", "true"})
# Program names whose version suffix carries no meaning for timing.
_VERSIONED = re.compile(r"^(python|pip|node|ruby|perl|php)[0-9.]*$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Names under which agents expose a shell as a JSON tool.
SHELL_TOOL_NAMES = frozenset(
    {
        "bash",
        "sh",
        "shell",
        "execute_bash",
        "run_bash",
        "run_command",
        "run_shell_command",
        "terminal",
        "execute_command",
        "exec",
        "cmd",
        "run",
    }
)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)
# A fenced shell block; an unclosed last block (output cut by max_tokens or a stop
# string) still counts, up to the end of the text.
_SHELL_BLOCK = re.compile(
    r"```[ \t]*(?:bash|sh|shell|zsh|console)[ \t]*\r?\n(?P<body>.*?)(?:```|\Z)",
    re.DOTALL | re.IGNORECASE,
)
_HERMES_CALL = re.compile(
    r"<tool_call>\s*(?P<body>.*?)\s*(?:(?P<closed></tool_call>)|\Z)", re.DOTALL
)
# The start of a Hermes call cut off by max_tokens: its name, complete, and a shell
# command if that much is complete too.
_CUT_CALL_NAME = re.compile(r'\A\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\\n]|\\.)*")')
_CUT_CALL_COMMAND = re.compile(r'"(?:command|cmd)"\s*:\s*(?P<command>"(?:[^"\\\n]|\\.)*")')
# Where a JSON tool call may start: an object whose first key is one a call uses.
_JSON_CALL_START = re.compile(r'\{\s*"(?:name|function|type|id|tool_calls|arguments)"')
# Shell operators that end the first command of a line.
_CHAIN_SPLIT = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")


def strip_thinking(text: str) -> str:
    """``text`` without reasoning: every ``<think>…</think>`` span, everything before a
    stray ``</think>`` (chat templates that open the tag in the prompt), and everything
    after an unclosed ``<think>`` (output cut while still reasoning)."""
    text = _THINK_BLOCK.sub("", text)
    last_close = None
    for last_close in _THINK_CLOSE.finditer(text):  # noqa: B007 - we want the last one
        pass
    if last_close is not None:
        text = text[last_close.end() :]
    opened = _THINK_OPEN.search(text)
    if opened is not None:
        text = text[: opened.start()]
    return text


def _split_words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        return command.split()


def command_key(command: str) -> str | None:
    """Normalised key of a shell command line, shared by the tool-time statistics and
    ContextServe's tables; ``None`` when there is no command.

    - leading ``VAR=value`` assignments and wrappers (``sudo``, ``env``, ``time``,
      ``timeout 30``, …) are skipped;
    - the program is its base name without a version suffix (``/usr/bin/python3.11`` →
      ``python``, ``pip3`` → ``pip``);
    - ``python -m MODULE …`` is keyed as ``MODULE …`` (``python -m pytest`` → ``pytest``);
    - programs in :data:`SUBCOMMAND_PROGRAMS` keep their subcommand (``git status``,
      ``pip install``, ``docker build``); every other program is one word
      (``pytest -x tests/`` → ``pytest``, ``ls -la`` → ``ls``).

    Only the first command of a chain counts (``pytest && echo ok`` → ``pytest``), but
    leading set-up steps are skipped (``cd /repo && make test`` → ``make``).
    """
    for segment in _CHAIN_SPLIT.split(command.strip()):
        key = _segment_key(_split_words(segment))
        if key is not None:
            return clean_tool_name(key) or None
    return None


def _segment_key(words: list[str]) -> str | None:
    index = 0
    after_wrapper = False
    while index < len(words):
        word = words[index]
        if _ASSIGNMENT.match(word) or word in _WRAPPERS or (after_wrapper and word[:1] == "-"):
            after_wrapper = after_wrapper or word in _WRAPPERS
            # ``sudo -u USER``, ``nice -n 10``: the option's value is not the program.
            index += 2 if after_wrapper and word in _WRAPPER_VALUE_OPTIONS else 1
        elif word == "timeout":
            index += 2  # ``timeout DURATION command``
            after_wrapper = True
        else:
            break
    if index >= len(words):
        return None
    program = words[index].rsplit("/", 1)[-1]
    versioned = _VERSIONED.match(program)
    if versioned:
        program = versioned.group(1)
    rest = words[index + 1 :]
    if program in _SETUP_COMMANDS:
        return None
    if program == "python" and len(rest) >= 2 and rest[0] == "-m":
        return _segment_key(rest[1:])
    if program in SUBCOMMAND_PROGRAMS and rest and not rest[0].startswith("-"):
        return f"{program} {rest[0]}"
    return program or None


def _first_command(block_body: str) -> str | None:
    """First meaningful command of a shell block: comments, blank lines, prompts
    (``$ ``) and set-up steps are skipped; backslash continuations are joined."""
    joined = re.sub(r"\\\r?\n", " ", block_body)
    for raw_line in joined.splitlines():
        line = raw_line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        if command_key(line) is not None:
            return line
    return None


def _last_shell_call(text: str) -> tuple[int, str] | None:
    """(position, command key) of the last fenced shell block with a command."""
    found: tuple[int, str] | None = None
    for match in _SHELL_BLOCK.finditer(text):
        command = _first_command(match.group("body"))
        if command is not None:
            key = command_key(command)
            if key is not None:
                found = (match.start(), key)
    return found


def _name_of_call(call: Any, *, named_is_enough: bool) -> str | None:
    """Tool name of one decoded JSON tool call, or None if it is not one."""
    if isinstance(call, list):
        for item in reversed(call):  # the last call of a batch ends the turn
            name = _name_of_call(item, named_is_enough=named_is_enough)
            if name is not None:
                return name
        return None
    if not isinstance(call, Mapping):
        return None
    if "tool_calls" in call:
        return _name_of_call(call["tool_calls"], named_is_enough=True)
    function = call.get("function")
    if isinstance(function, Mapping):
        return _name_of_call(function, named_is_enough=True)
    name = call.get("name")
    if not isinstance(name, str):
        return None
    arguments = call.get("arguments", call.get("parameters", call.get("args")))
    if arguments is None and not named_is_enough:
        # {"name": …} alone is ordinary JSON output, not a call.
        return None
    return call_key(name, arguments)


def call_key(name: str, arguments: Any = None) -> str | None:
    """Key of a tool call named ``name``: a shell tool (:data:`SHELL_TOOL_NAMES`) whose
    arguments (a mapping, or its JSON text) carry a ``command`` is keyed by that
    command's :func:`command_key`, so it shares statistics with fenced blocks; any
    other call by its cleaned name. None for an empty name."""
    if not name.strip():
        return None
    if name.strip() in SHELL_TOOL_NAMES:
        command = _shell_command_argument(arguments)
        if command is not None:
            key = command_key(command)
            if key is not None:
                return key
    return clean_tool_name(name) or None


def _shell_command_argument(arguments: Any) -> str | None:
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if isinstance(arguments, Mapping):
        for field in ("command", "cmd", "script"):
            value = arguments.get(field)
            if isinstance(value, str) and value.strip():
                return value
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                return " ".join(value)
    return None


def _cut_call(body: str) -> dict[str, Any] | None:
    """The call an unterminated ``<tool_call>`` body starts (output cut by
    ``max_tokens``): its name once that is complete, with the shell command if that
    is complete too; None when not even the name is."""
    name_match = _CUT_CALL_NAME.match(body)
    if name_match is None:
        return None
    try:
        call: dict[str, Any] = {"name": json.loads(name_match.group("name"))}
        command_match = _CUT_CALL_COMMAND.search(body, name_match.end())
        if command_match is not None:
            call["arguments"] = {"command": json.loads(command_match.group("command"))}
    except ValueError:
        return None
    return call


def _last_json_call(text: str) -> tuple[int, str] | None:
    """(position, tool name) of the last Hermes or JSON tool call."""
    decoder = json.JSONDecoder()
    found: tuple[int, str] | None = None
    for match in _HERMES_CALL.finditer(text):
        body = match.group("body")
        try:
            value, _ = decoder.raw_decode(body)
        except ValueError:
            if match.group("closed") is not None:
                continue
            value = _cut_call(body)
        name = _name_of_call(value, named_is_enough=True)
        if name is not None:
            found = (match.start(), name)
    # Bare JSON calls: try each plausible start, latest first, and keep the first that
    # decodes. Only starts matching _JSON_CALL_START are tried, which keeps this linear
    # in practice; at most 32 are tried.
    starts = [m.start() for m in _JSON_CALL_START.finditer(text)]
    for start in reversed(starts[-32:]):
        if found is not None and start <= found[0]:
            break
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        name = _name_of_call(value, named_is_enough=False)
        if name is not None:
            found = (start, name)
            break
    return found


def parse_tool(output_text: str) -> str | None:
    """Tool called at the end of a model output, or None for plain text."""
    text = strip_thinking(output_text)[-TAIL_CHARS:]
    candidates = [c for c in (_last_shell_call(text), _last_json_call(text)) if c is not None]
    if not candidates:
        return None
    return max(candidates, key=lambda candidate: candidate[0])[1]


def resolve_tool(client_tool: str | None, output_text: str | None) -> str | None:
    """The tool a finished turn called: the client's or an orchestrator's name wins
    (cleaned); else what the output shows."""
    named = clean_tool_name(client_tool) if client_tool is not None else ""
    if named:
        return named
    if not output_text:
        return None
    return parse_tool(output_text)
