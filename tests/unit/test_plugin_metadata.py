"""Request metadata from vllm_xargs / session_id, and plugin settings from the environment."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_plugin import register
from vllm_plugin.metadata import read_metadata
from vllm_plugin.settings import PluginSettings, PluginSettingsError


def request(extra_args: object = None, session_id: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id="r1", session_id=session_id,
                           sampling_params=SimpleNamespace(extra_args=extra_args))


@pytest.mark.parametrize(
    ("extra", "session", "job", "last", "tool"),
    [
        ({"job_id": "j1", "is_last_step": 0}, None, "j1", False, ""),
        ({"job_id": "j1", "is_last_step": 1, "tool": "pytest"}, None, "j1", True, "pytest"),
        ({"job_id": "j1", "is_last_step": "true"}, "s9", "j1", True, ""),
        ({"job_id": 42}, None, "42", False, ""),
        (None, "session-7", "session-7", False, ""),
        ({}, None, "", False, ""),
        (None, None, "", False, ""),
    ],
)
def test_reads_job_metadata(extra: object, session: str | None, job: str, last: bool,
                            tool: str) -> None:
    meta = read_metadata(request(extra, session))
    assert (meta.job_id, meta.is_last_step, meta.tool) == (job, last, tool)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"job_id": ["not", "a", "string"]}, "job_id"),
        ({"is_last_step": 7}, "is_last_step"),
        ({"tool": {"name": "ls"}}, "tool"),
        ({"retention_directives": "priority 100"}, "retention_directives"),
    ],
)
def test_bad_fields_are_ignored_with_a_warning(
    extra: dict[str, object], field: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtether.plugin"):
        meta = read_metadata(request(extra))
    assert f"ignoring vllm_xargs {field}=" in caplog.text
    assert meta.job_id == "" or field != "job_id"


def test_settings_defaults_and_overrides() -> None:
    default = PluginSettings.from_env({})
    assert default.daemon_address == "127.0.0.1:50051" and default.deadline_s == 0.020
    assert not default.fail_closed and default.enabled and default.engine_id
    assert default.returned_job_priority == 90 and default.waiting_demand_interval_s == 0.100
    assert default.waiting_demand_thread == "link"
    custom = PluginSettings.from_env({
        "KVTETHER_PLUGIN_DAEMON_ADDRESS": "unix:/run/k.sock",
        "KVTETHER_PLUGIN_DEADLINE_MS": "2.5",
        "KVTETHER_PLUGIN_FAIL_MODE": "closed",
        "KVTETHER_PLUGIN_ENGINE_ID": "pod-a",
        "KVTETHER_PLUGIN_ENABLED": "yes",
        "KVTETHER_PLUGIN_WAITING_DEMAND_MS": "0",
        "KVTETHER_PLUGIN_WAITING_DEMAND_THREAD": " Engine ",
    })
    assert (custom.daemon_address, custom.deadline_s, custom.fail_closed, custom.engine_id,
            custom.enabled, custom.waiting_demand_interval_s,
            custom.waiting_demand_thread) == (
                "unix:/run/k.sock", 0.0025, True, "pod-a", True, 0.0, "engine")


@pytest.mark.parametrize(("variable", "nearest"), [
    ("KVTETHER_PLUGIN_DAEMON_ADRESS", "KVTETHER_PLUGIN_DAEMON_ADDRESS"),
    ("KVTETHER_PLUGIN_DEADLINE_S", "KVTETHER_PLUGIN_DEADLINE_MS"),
    ("KVTETHER_PLUGIN_ENABLE", "KVTETHER_PLUGIN_ENABLED"),
    ("KVTETHER_PLUGIN_TLS_CA", "KVTETHER_PLUGIN_TLS_CA_FILE"),
])
def test_an_unknown_variable_is_an_error_naming_the_nearest_valid_one(
        variable: str, nearest: str) -> None:
    with pytest.raises(PluginSettingsError) as error:
        PluginSettings.from_env({variable: "unix:/x"})
    assert str(error.value) == f"{variable}: unknown variable; did you mean {nearest}?"


def test_an_unknown_variable_like_no_valid_one_points_to_the_docs() -> None:
    with pytest.raises(PluginSettingsError, match="KVTETHER_PLUGIN_ZZZ: unknown variable; "
                                                  "see the plugin settings"):
        PluginSettings.from_env({"KVTETHER_PLUGIN_ZZZ": "1"})


@pytest.mark.parametrize("off", ["0", "false", " No "])
def test_disabled_reads_no_other_variable(off: str) -> None:
    garbage = {"KVTETHER_PLUGIN_ENABLED": off, "KVTETHER_PLUGIN_DEADLINE_MS": "fast",
               "KVTETHER_PLUGIN_DAEMON_ADRESS": "unix:/x",
               "KVTETHER_PLUGIN_TOKEN_FILE": "/no/such/file",
               "KVTETHER_PLUGIN_FAIL_MODE": "sideways"}
    assert PluginSettings.from_env(garbage) == PluginSettings(enabled=False)


def test_register_stops_vllm_with_one_line_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_PLUGIN_DAEMON_ADRESS", "unix:/x")
    with pytest.raises(SystemExit) as stop:
        register()
    assert stop.value.code == ("kvtether: KVTETHER_PLUGIN_DAEMON_ADRESS: unknown variable; "
                               "did you mean KVTETHER_PLUGIN_DAEMON_ADDRESS?")
    monkeypatch.setenv("KVTETHER_PLUGIN_ENABLED", "0")
    monkeypatch.setenv("KVTETHER_PLUGIN_DEADLINE_MS", "fast")
    register()  # switched off: vLLM starts whatever else is set


@pytest.mark.parametrize(
    ("name", "value"),
    [("DEADLINE_MS", "fast"), ("DEADLINE_MS", "-1"), ("FAIL_MODE", "sideways"),
     ("ENABLED", "maybe"), ("DAEMON_ADDRESS", ""), ("MAX_PIN_S", "nan"),
     ("RETURNED_JOB_PRIORITY", "101"), ("RETURNED_JOB_PRIORITY", "50.5"),
     ("RETURNED_JOB_PRIORITY", "-1"), ("WAITING_DEMAND_MS", "-5"),
     ("WAITING_DEMAND_THREAD", "worker")],
)
def test_bad_settings_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(PluginSettingsError, match=f"KVTETHER_PLUGIN_{name}"):
        PluginSettings.from_env({f"KVTETHER_PLUGIN_{name}": value})


def test_the_engine_token_comes_from_a_variable_or_a_file(tmp_path: Path) -> None:
    assert PluginSettings.from_env({}).token == ""
    token = "engine-token-0123456789"
    assert PluginSettings.from_env({"KVTETHER_PLUGIN_TOKEN": token}).token == token
    secret = tmp_path / "token"
    secret.write_text(f"{token}\n")
    settings = PluginSettings.from_env({"KVTETHER_PLUGIN_TOKEN_FILE": str(secret)})
    assert settings.token == token and token not in repr(settings)


@pytest.mark.parametrize(
    ("variables", "message"),
    [({"TOKEN": "a", "TOKEN_FILE": "/etc/hostname"}, "TOKEN and KVTETHER_PLUGIN_TOKEN_FILE: "
                                                     "set one, not both"),
     ({"TOKEN_FILE": "/nonexistent/token"}, "TOKEN_FILE: cannot read '/nonexistent/token'"),
     ({"TOKEN": "has space"}, "TOKEN: must be printable ASCII without spaces")],
)
def test_a_bad_engine_token_setting_names_the_variable(
        variables: dict[str, str], message: str) -> None:
    with pytest.raises(PluginSettingsError, match=f"KVTETHER_PLUGIN_{message}") as refused:
        PluginSettings.from_env({f"KVTETHER_PLUGIN_{name}": value
                                 for name, value in variables.items()})
    assert "has space" not in str(refused.value)


def test_a_client_named_tool_is_one_bounded_line(caplog: pytest.LogCaptureFixture) -> None:
    # A client's tool is cleaned like a parsed one: one line, cut at 128, never dropped.
    assert read_metadata(request({"tool": "pytest\n-x\t\x1b[31m"})).tool == "pytest -x [31m"
    assert read_metadata(request({"tool": "t" * 300})).tool == "t" * 128
    assert read_metadata(request({"tool": "*"})).tool == ""


def test_a_job_id_over_the_limit_keeps_its_job(caplog: pytest.LogCaptureFixture) -> None:
    # A job id over the limit keeps its job: every turn maps to the same bounded id,
    # two long ids never share one, and the engine log says so once per job.
    first = "job-" + "a" * 400
    second = "job-" + "a" * 399 + "b"
    with caplog.at_level(logging.WARNING, logger="kvtether.plugin"):
        turns = [read_metadata(request({"job_id": first})).job_id for _ in range(3)]
        other = read_metadata(request({"job_id": second})).job_id
        by_session = read_metadata(request(None, session_id=first)).job_id
    assert turns[0] and turns == [turns[0]] * 3 and by_session == turns[0]
    assert len(turns[0]) <= 256 and len(other) <= 256 and other != turns[0]
    assert turns[0].startswith("job-aaaa")
    assert caplog.text.count("job_id") + caplog.text.count("session_id") == 2
    scope = read_metadata(request({"retention_scope": "s" * 300})).retention_scope
    assert 0 < len(scope) <= 256


def test_without_a_tool_parser_nothing_of_vllm_is_imported() -> None:
    # KVTETHER_PLUGIN_TOOL_PARSER unset: the settings, the agent and its tool reading
    # import no vLLM module (vLLM's parsers load only when the variable names one).
    probe = ("import sys\n"
             "from vllm_plugin.settings import PluginSettings\n"
             "import vllm_plugin.agent, vllm_plugin.metadata, vllm_plugin.vllm_tool_parser\n"
             "assert PluginSettings.from_env({}).tool_parser == ''\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('vllm', 'torch', 'transformers')))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, check=True, env={**os.environ,
                                                         "PYTHONPATH": ":".join(sys.path)})
    assert result.stdout.strip() == "[]"
