"""KVTETHER_PLUGIN_TOOL_PARSER: the tool a finished turn called, read by vLLM's own tool
parser (the installed vLLM's real classes) from the output's token ids, as the plugin
records it; kvtether's own parsing where vLLM's finds none.

Outputs are in each model's format as vLLM's parser tests and the models' docs write
them. Tokenizers: the tiny test model's, with the markers a model's tokenizer holds as
special tokens added as special tokens (so they survive decoding only as the serving
layer decodes a request with tools: without skipping special tokens); Mistral's own
tokenizer, which mistral_common ships; gpt-oss token ids from openai_harmony's own
encoding (Harmony is parsed from ids, not text).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.api.toolcalls import resolve_tool
from tests.support.engine import requires_vllm, tiny_model_dir
from vllm_plugin.metadata import TOOL_TAIL_TOKENS, RequestMetadata, tool_at_finish
from vllm_plugin.settings import PluginSettings, PluginSettingsError
from vllm_plugin.vllm_tool_parser import VllmToolParser

pytestmark = requires_vllm

TINY_EOS = "<|im_end|>"  # the tiny model's end of turn, a special token


@cache
def tokenizer_with(*special_tokens: str) -> Any:
    """The tiny model's tokenizer with a model's markers added as special tokens,
    wrapped as vLLM wraps every tokenizer it loads."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    return get_cached_tokenizer(tokenizer)


@cache
def mistral_tokenizer(tmp_dir: Path) -> Any:
    """Mistral's own tekken tokenizer (Mistral-Nemo's, shipped in mistral_common), as
    vLLM loads it with --tokenizer-mode mistral."""
    import mistral_common
    from vllm.tokenizers import get_tokenizer

    shutil.copy(Path(mistral_common.__file__).parent / "data" / "tekken_240911.json",
                tmp_dir / "tekken.json")
    return get_tokenizer(str(tmp_dir), tokenizer_mode="mistral")


@dataclass
class FinishedRequest:
    """What the plugin reads off a vLLM request at its end."""

    output_token_ids: list[int]
    stop_token_ids: set[int] = field(default_factory=set)
    request_id: str = "r1"

    @property
    def sampling_params(self) -> Any:
        return SimpleNamespace(all_stop_token_ids=self.stop_token_ids)


def recorded_tool(parser: VllmToolParser | None, tokenizer: Any, token_ids: Sequence[int],
                  stop_token_ids: set[int] | None = None, client_tool: str = "") -> str | None:
    """The tool the plugin records for a finished turn with this output."""
    def decode_tail(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    request = FinishedRequest(list(token_ids), stop_token_ids or set())
    return tool_at_finish(request, RequestMetadata(tool=client_tool), decode_tail,
                          resolve_tool, parser)


def encoded(tokenizer: Any, text: str, stop: str | None = TINY_EOS) -> tuple[list[int], set[int]]:
    """Token ids of ``text`` as the model generates it, ending with its stop token."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if stop is None:
        return ids, set()
    stop_id = tokenizer.get_vocab()[stop]
    return [*ids, stop_id], {stop_id}


@dataclass(frozen=True)
class Format:
    parser: str
    output: str
    tool: str
    special_tokens: tuple[str, ...] = ()
    stop: str = TINY_EOS
    # What kvtether's own parsing records for the same output.
    own: str | None = None


def deepseek(name: str) -> str:
    """A DeepSeek marker: its bars are U+FF5C, its spaces U+2581 (as DeepSeek writes them)."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


DEEPSEEK_MARKERS = tuple(deepseek(name) for name in (
    "tool calls begin", "tool calls end", "tool call begin", "tool call end", "tool sep",
    "end of sentence"))
KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
GLM_MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>", "<|observation|>")

FORMATS = [
    pytest.param(Format(
        "qwen3_coder",
        "Sure! Let me check the weather for you.<tool_call>\n<function=get_current_weather>\n"
        "<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n</parameter>\n"
        "<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>",
        "get_current_weather"), id="qwen3-coder-xml"),
    pytest.param(Format(
        "pythonic",
        "[get_weather(city='San Francisco', metric='celsius'), "
        "register_user(name='John Doe', age=37)]",
        "register_user"), id="pythonic"),
    pytest.param(Format(
        "llama4_pythonic",
        "<|python_start|>[get_weather(city='LA', metric='C')]<|python_end|>",
        "get_weather", ("<|python_start|>", "<|python_end|>", "<|eot|>"), "<|eot|>"),
        id="llama4-pythonic"),
    pytest.param(Format(
        "deepseek_v3",
        f"Let me check the weather for you.{deepseek('tool calls begin')}"
        f"{deepseek('tool call begin')}function{deepseek('tool sep')}get_weather\n```json\n"
        f"{{\"city\": \"Paris\"}}\n```{deepseek('tool call end')}{deepseek('tool calls end')}",
        "get_weather", DEEPSEEK_MARKERS, deepseek("end of sentence")), id="deepseek-v3"),
    pytest.param(Format(
        "kimi_k2",
        "Compare weather. <|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0 <|tool_call_argument_begin|>"
        "{\"city\": \"Beijing\"}<|tool_call_end|>"
        "<|tool_call_begin|>functions.get_news:1 <|tool_call_argument_begin|>"
        "{\"topic\": \"technology\"}<|tool_call_end|><|tool_calls_section_end|>",
        "get_news", KIMI_MARKERS), id="kimi-k2"),
    pytest.param(Format(
        "glm45",
        "I will help you get the weather.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Beijing</arg_value>\n<arg_key>date</arg_key>\n"
        "<arg_value>2025-08-01</arg_value>\n</tool_call>",
        "get_weather", GLM_MARKERS, "<|observation|>"), id="glm-4.5"),
    pytest.param(Format(
        "mistral",
        "[TOOL_CALLS]get_current_weather[ARGS]"
        "{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}",
        "get_current_weather", ("[TOOL_CALLS]", "[ARGS]", "</s>"), "</s>"),
        id="mistral-v11-tool-calls-args"),
    pytest.param(Format(
        "hermes",
        "<tool_call>\n{\"name\": \"execute_bash\", \"arguments\": "
        "{\"command\": \"python -m pytest -x tests/\"}}\n</tool_call>",
        "pytest", own="pytest"), id="hermes-shell-tool-keyed-by-command"),
]


@pytest.mark.parametrize("case", FORMATS)
def test_each_format_records_the_tool_vllms_parser_reads(case: Format) -> None:
    tokenizer = tokenizer_with(*case.special_tokens)
    ids, stops = encoded(tokenizer, case.output, case.stop)
    parser = VllmToolParser(case.parser, lambda: tokenizer)
    assert recorded_tool(parser, tokenizer, ids, stops) == case.tool
    # Without the setting, kvtether's own parsing: for these formats, no tool.
    assert recorded_tool(None, tokenizer, ids, stops) == case.own


def test_mistral_with_its_own_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Mistral-Nemo's tekken tokenizer (before v11): [TOOL_CALLS] then a JSON list.
    tokenizer = mistral_tokenizer(tmp_path_factory.mktemp("mistral"))
    vocab = tokenizer.get_vocab()
    ids = [vocab["[TOOL_CALLS]"], *tokenizer.encode(
        '[{"name": "get_current_weather", "arguments": {"city": "San Francisco"}}, '
        '{"name": "read_file", "arguments": {"path": "a.py"}}]', add_special_tokens=False),
        tokenizer.eos_token_id]
    parser = VllmToolParser("mistral", lambda: tokenizer)
    assert recorded_tool(parser, tokenizer, ids, {tokenizer.eos_token_id}) == "read_file"


HARMONY_OUTPUT = (
    "<|channel|>analysis<|message|>User asks: \"What is the weather in Tokyo?\" We need to "
    "use get_current_weather tool.{padding}<|end|><|start|>assistant<|channel|>commentary "
    "to=functions.get_current_weather <|constrain|>json<|message|>{{\"location\": "
    "\"Tokyo\"}}<|call|>"
)


@pytest.mark.parametrize("reasoning_words", [0, 2 * TOOL_TAIL_TOKENS],
                         ids=["whole-output", "tail-starts-inside-the-reasoning"])
def test_gpt_oss_harmony_from_token_ids(reasoning_words: int) -> None:
    # gpt-oss: vLLM reads Harmony from the token ids with openai_harmony's encoding (the
    # ids a gpt-oss engine generates); the model's tokenizer only decodes text.
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    output = HARMONY_OUTPUT.format(padding=" Let me think." * reasoning_words)
    ids = encoding.encode(output, allowed_special="all")
    stops = set(encoding.stop_tokens_for_assistant_actions())
    assert len(ids) > TOOL_TAIL_TOKENS or not reasoning_words
    gpt_oss = SimpleNamespace(model="openai/gpt-oss-20b",
                              hf_config=SimpleNamespace(model_type="gpt_oss"))
    tokenizer = tokenizer_with()
    parser = VllmToolParser("openai", lambda: tokenizer, gpt_oss)
    request = FinishedRequest(ids, stops)
    tool = tool_at_finish(request, RequestMetadata(), lambda _: "", resolve_tool, parser)
    assert tool == "get_current_weather"


def test_one_parser_reads_turn_after_turn() -> None:
    # Built once and reused: one turn's output leaves nothing behind for the next.
    tokenizer = tokenizer_with(*KIMI_MARKERS)
    parser = VllmToolParser("kimi_k2", lambda: tokenizer)
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0 "
            "<|tool_call_argument_begin|>{{}}<|tool_call_end|><|tool_calls_section_end|>")
    for name in ("read_file", "run_tests", "read_file"):
        ids, stops = encoded(tokenizer, call.format(name=name))
        assert recorded_tool(parser, tokenizer, ids, stops) == name
    ids, stops = encoded(tokenizer, "All done, the tests pass.")
    assert recorded_tool(parser, tokenizer, ids, stops) is None


@pytest.mark.parametrize(("output", "tool"), [
    pytest.param("Running the tests.\n```bash\npytest -x\n```", "pytest",
                 id="vllm-finds-none-kvtether-reads-a-shell-block"),
    pytest.param('<tool_call>\n{"name": "search_code", "arguments": {"query": "def ma',
                 "search_code", id="hermes-cut-off-by-max-tokens"),
    pytest.param("<think>Maybe <tool_call>\n<function=rm_all>\n</function>\n</tool_call>"
                 "</think>I am done.", None, id="a-call-drafted-while-reasoning-is-no-call"),
])
def test_kvtether_parsing_where_vllms_finds_none(output: str, tool: str | None) -> None:
    tokenizer = tokenizer_with()
    ids, stops = encoded(tokenizer, output)
    parser = VllmToolParser("qwen3_coder", lambda: tokenizer)
    assert recorded_tool(parser, tokenizer, ids, stops) == tool


def test_the_clients_tool_wins_and_vllms_parser_is_not_asked() -> None:
    tokenizer = tokenizer_with()
    ids, stops = encoded(tokenizer, "[get_weather(city='LA')]")

    class Refuses(VllmToolParser):
        def tool(self, *args: Any, **kwargs: Any) -> str | None:
            raise AssertionError("asked")

    parser = Refuses("pythonic", lambda: tokenizer)
    assert recorded_tool(parser, tokenizer, ids, stops, client_tool="web search") == "web search"


def test_a_parser_that_cannot_run_warns_once_and_never_fails_a_request(
        caplog: pytest.LogCaptureFixture) -> None:
    # DeepSeek-V3's parser needs its markers in the tokenizer; the tiny one has none.
    tokenizer = tokenizer_with()
    parser = VllmToolParser("deepseek_v3", lambda: tokenizer)
    ids, stops = encoded(tokenizer, "```bash\nmake test\n```")
    with caplog.at_level(logging.DEBUG, logger="kvtether.plugin"):
        tools = [recorded_tool(parser, tokenizer, ids, stops) for _ in range(3)]
    assert tools == ["make"] * 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'deepseek_v3'" in warnings[0].getMessage()
    assert "could not locate tool call start/end tokens" in warnings[0].getMessage()


def test_a_parser_raising_on_an_output_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = tokenizer_with()
    parser = VllmToolParser("hermes", lambda: tokenizer)
    ids, stops = encoded(tokenizer, '<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    assert recorded_tool(parser, tokenizer, ids, stops) == "ls"  # built

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("bad output")

    monkeypatch.setattr(parser._parser, "parse", broken)
    assert recorded_tool(parser, tokenizer, ids, stops) == "ls"  # kvtether's own


@pytest.mark.parametrize(("name", "hint"), [
    ("qwen3coder", "did you mean qwen3_coder"),
    ("kimi-k2", "did you mean kimi_k2"),
    ("gpt-oss", "see --tool-call-parser in vllm serve --help"),
])
def test_an_unknown_parser_name_is_one_line_naming_the_nearest(name: str, hint: str) -> None:
    with pytest.raises(PluginSettingsError) as refused:
        PluginSettings.from_env({"KVTETHER_PLUGIN_TOOL_PARSER": name})
    message = str(refused.value)
    assert message.startswith(f"KVTETHER_PLUGIN_TOOL_PARSER: {name!r} is not a vLLM tool "
                              "parser; ")
    assert hint in message and "\n" not in message


def test_a_registered_name_is_taken() -> None:
    assert PluginSettings.from_env({"KVTETHER_PLUGIN_TOOL_PARSER": " glm45 "}).tool_parser \
        == "glm45"


def test_vllm_refuses_to_start_on_an_unknown_parser_name() -> None:
    # The vllm.general_plugins entry point: one line, no traceback.
    result = subprocess.run(
        [sys.executable, "-c", "import vllm_plugin; vllm_plugin.register()"],
        env={"KVTETHER_PLUGIN_TOOL_PARSER": "hermess", "PATH": "/usr/bin:/bin",
             "PYTHONPATH": ":".join(sys.path)},
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "kvtether: KVTETHER_PLUGIN_TOOL_PARSER: 'hermess' is not a vLLM tool parser; "
        "did you mean hermes?")



def test_vllms_real_scheduler_records_the_tool_of_a_finished_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The setting through the scheduler vLLM builds (--scheduler-cls): the model's own
    # tokenizer, loaded by the plugin; the engine generates a Qwen3-Coder call.
    from tests.support.redis_server import free_port
    from tests.support.scheduler import build_scheduler, make_request, model_output
    from vllm_plugin.scheduler import KvtetherScheduler

    monkeypatch.setenv("KVTETHER_PLUGIN_DAEMON_ADDRESS", f"127.0.0.1:{free_port()}")  # none
    monkeypatch.setenv("KVTETHER_PLUGIN_TOOL_PARSER", "qwen3_coder")
    sched = build_scheduler(tiny_model_dir(), num_blocks=64, scheduler_cls=KvtetherScheduler)
    # The harness skips the tokenizer, which a served model always has.
    sched.vllm_config.model_config.skip_tokenizer_init = False
    recorded: dict[str, str] = {}
    take_blocks = sched.kvtether.take_blocks

    def record(request: Any) -> bool:
        recorded[request.request_id] = sched.kvtether.metadata[request.request_id].tool
        return bool(take_blocks(request))

    monkeypatch.setattr(sched.kvtether, "take_blocks", record)
    tokenizer = tokenizer_with()
    script = tokenizer.encode("Let me look.<tool_call>\n<function=read_file>\n<parameter=path>"
                              "\nsrc/main.py\n</parameter>\n</function>\n</tool_call>",
                              add_special_tokens=False)
    try:
        sched.add_request(make_request("turn-1", list(range(100, 140)), len(script),
                                       extra_args={"job_id": "job-1", "is_last_step": 0}))
        for token_id in script:
            output = sched.schedule()
            sched.update_from_output(output, model_output(sched, output, token_id))
        assert not sched.has_unfinished_requests()
    finally:
        sched.shutdown()
    assert recorded == {"turn-1": "read_file"}
