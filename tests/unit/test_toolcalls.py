"""Which tool a finished turn called, from its output (or the client's word)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.api.toolcalls import command_key, parse_tool, resolve_tool, strip_thinking

FENCE = "```"


def bash(body: str, lang: str = "bash") -> str:
    return f"{FENCE}{lang}\n{body}\n{FENCE}"


@pytest.mark.parametrize(
    ("command", "key"),
    [
        ("ls", "ls"),
        ("ls -la /repo", "ls"),
        ("pytest -x tests/unit", "pytest"),
        ("python -m pytest -q", "pytest"),
        ("python3.11 -m pip install -e .", "pip install"),
        ("pip3 install numpy", "pip install"),
        ("git status", "git status"),
        ("git -C repo status", "git"),  # an option before the subcommand: the program only
        ("docker build -t x .", "docker build"),
        ("/usr/bin/make -j8", "make"),
        ("sudo -u root apt-get install -y redis", "apt-get install"),
        ("FOO=1 BAR=2 timeout 30 make test", "make"),
        ("cd /repo && pytest", "pytest"),
        ("cd /repo; export X=1; npm test", "npm test"),
        ("pytest && echo done", "pytest"),
        ("cat a.py | grep TODO", "cat"),
        ("grep -r 'a|b' .", "grep"),  # quoted operators do not split
        ("echo 'unbalanced", "echo"),
        ("", None),
        ("cd /repo", None),
        ("# just a comment", None),
    ],
)
def test_command_key(command: str, key: str | None) -> None:
    assert command_key(command) == key


@pytest.mark.parametrize(
    ("output", "tool"),
    [
        pytest.param(bash("ls"), "ls", id="bash-block"),
        pytest.param("Let me look.\n" + bash("cat main.py"), "cat", id="text-then-block"),
        pytest.param(
            bash("ls", "sh") + "\n" + bash("git status", "shell"),
            "git status",
            id="last-block-wins",
        ),
        pytest.param(
            bash("# run the tests\n\n$ python -m pytest \\\n  -x tests"),
            "pytest",
            id="comments-prompt-continuation",
        ),
        pytest.param(bash("cd /repo\npip install -e ."), "pip install", id="setup-line-skipped"),
        pytest.param(bash("ls") + "\n" + bash(""), "ls", id="empty-last-block-ignored"),
        pytest.param(f"{FENCE}bash\nmake test", "make", id="unclosed-block-cut-by-max-tokens"),
        pytest.param(f"{FENCE}python\nprint(1)\n{FENCE}", None, id="non-shell-block"),
        pytest.param(f"{FENCE}\nls\n{FENCE}", None, id="unlabelled-block"),
        pytest.param("I think the answer is 42.", None, id="plain-text"),
        pytest.param("", None, id="empty"),
    ],
)
def test_fenced_shell_blocks(output: str, tool: str | None) -> None:
    assert parse_tool(output) == tool


@pytest.mark.parametrize(
    ("output", "tool"),
    [
        pytest.param(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "get_weather",
            id="hermes",
        ),
        pytest.param(
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
            "b",
            id="hermes-last-wins",
        ),
        pytest.param('{"name": "search", "arguments": {"q": "x"}}', "search", id="openai-flat"),
        pytest.param(
            'Calling: {"type": "function", "function": {"name": "read_file", '
            '"arguments": "{\\"path\\": \\"a\\"}"}}',
            "read_file",
            id="openai-function",
        ),
        pytest.param(
            json.dumps(
                {
                    "tool_calls": [
                        {"function": {"name": "x", "arguments": "{}"}},
                        {"function": {"name": "y", "arguments": "{}"}},
                    ]
                }
            ),
            "y",
            id="tool-calls-list-last",
        ),
        pytest.param(
            json.dumps({"name": "execute_bash", "arguments": {"command": "pytest -x"}}),
            "pytest",
            id="shell-tool-keyed-by-command",
        ),
        pytest.param(
            json.dumps(
                {"function": {"name": "bash", "arguments": json.dumps({"command": "git status"})}}
            ),
            "git status",
            id="shell-tool-string-arguments",
        ),
        pytest.param(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
            "get_weather",
            id="hermes-cut-off-by-max-tokens",
        ),
        pytest.param(
            '<tool_call>{"name": "bash", "arguments": {"command": "git status", "timeout": 3',
            "git status",
            id="hermes-cut-off-shell-tool-keyed-by-its-complete-command",
        ),
        pytest.param(
            '<tool_call>{"name": "bash", "arguments": {"command": "pyte',
            "bash",
            id="hermes-cut-off-inside-the-command",
        ),
        pytest.param('<tool_call>{"name": "get_wea', None, id="hermes-cut-off-inside-the-name"),
        pytest.param(
            '<tool_call>{"name": "x", "arguments": {</tool_call>', None, id="hermes-closed-not-json"
        ),
        pytest.param('{"name": "Alice", "age": 3}', None, id="json-that-is-not-a-call"),
        pytest.param('{"name": "x", "arguments": ', None, id="truncated-json"),
    ],
)
def test_json_and_hermes_calls(output: str, tool: str | None) -> None:
    assert parse_tool(output) == tool


def test_the_later_of_a_json_call_and_a_bash_block_wins() -> None:
    json_call = '{"name": "search", "arguments": {}}'
    assert parse_tool(bash("ls") + "\n" + json_call) == "search"
    assert parse_tool(json_call + "\n" + bash("ls")) == "ls"


@pytest.mark.parametrize(
    ("output", "tool"),
    [
        pytest.param(
            f"<think>maybe {bash('rm -rf /')}? no.</think>\n{bash('ls')}",
            "ls",
            id="draft-inside-thinking-ignored",
        ),
        pytest.param(
            f"<think>I could run {bash('pytest')}</think>\nDone, no command.",
            None,
            id="only-thinking-has-a-command",
        ),
        pytest.param(
            f"reasoning {bash('pytest')} ...</think>\n{bash('cat x')}",
            "cat",
            id="template-opened-think-in-prompt",
        ),
        pytest.param(
            f"{bash('ls')}<think>then {bash('make')}", "ls", id="unclosed-think-cut-by-max-tokens"
        ),
        pytest.param(f"<THINK>{bash('make')}</THINK>{bash('pwd')}", "pwd", id="case-insensitive"),
    ],
)
def test_thinking_is_stripped_first(output: str, tool: str | None) -> None:
    assert parse_tool(output) == tool


def test_strip_thinking_keeps_the_answer() -> None:
    assert strip_thinking("<think>a</think>answer<think>b</think> too") == "answer too"


def test_client_tool_wins_verbatim() -> None:
    assert resolve_tool("web search", bash("ls")) == "web search"
    assert resolve_tool("  pytest  ", None) == "pytest"
    assert resolve_tool("", bash("ls")) == "ls"
    assert resolve_tool(None, bash("ls")) == "ls"
    assert resolve_tool(None, None) is None
    assert len(resolve_tool("x" * 1000, None) or "") == 128


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_never_raises_on_any_output(output: str) -> None:
    tool = resolve_tool(None, output)
    assert tool is None or 0 < len(tool) <= 128


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet='{}[]":,nameargumentsfunction<>/_ \n`bash', max_size=300))
def test_never_raises_on_json_like_garbage(output: str) -> None:
    parse_tool(output)


def test_tool_names_from_client_or_output_are_one_bounded_line() -> None:
    # Whether the client names the tool or the model's output does, the name is one
    # bounded line of text, cut (never dropped) at the same length.
    long_name = "t" * 300
    hermes = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>'
    assert resolve_tool("pytest\n-x\r\n\x00", None) == "pytest -x"
    assert resolve_tool(None, hermes % "run\\ntests\\u0007") == "run tests"
    assert resolve_tool(None, hermes % long_name) == resolve_tool(long_name, None) == "t" * 128
    shell_call = '{"name": "bash", "arguments": {"command": "\'make\\u0007all\' -j4"}}'
    assert resolve_tool(None, shell_call) == "make all"
    # The reserved pool name is no tool: the client's "*" leaves the output to say.
    assert resolve_tool("*", bash("ls")) == "ls"
    assert resolve_tool(None, hermes % "*") is None
