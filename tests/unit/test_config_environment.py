"""The daemon's configuration refuses what would otherwise be ignored: KVTETHER_*
variables that set nothing, and auth settings that name scopes with no token."""

from __future__ import annotations

import pytest

from sidecar.config import ConfigError, load_config

ENGINE_TOKEN = "engine-token-0123456789"


@pytest.mark.parametrize(("variable", "message"), [
    ("KVTETHER_POLCY__NAME", "KVTETHER_POLCY__NAME: unknown variable; did you mean "
                             "KVTETHER_POLICY__NAME?"),
    ("KVTETHER_AUTH_TOKENS", "KVTETHER_AUTH_TOKENS: unknown variable; did you mean "
                             "KVTETHER_AUTH__TOKENS?"),
    ("KVTETHER_GRACE_S__X", "KVTETHER_GRACE_S__X: unknown variable; did you mean "
                            "KVTETHER_GRACE_S?"),
    ("KVTETHER_ZZZ", "KVTETHER_ZZZ: unknown variable; see the daemon settings in "
                     "docs/operations.md"),
])
def test_a_variable_that_sets_nothing_is_refused(variable: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(environ={variable: "x"})
    assert str(refused.value) == message


def test_the_daemons_variables_and_others_pass() -> None:
    load_config(environ={
        "KVTETHER_POLICY__NAME": "fcfs", "KVTETHER_POLICY__PARAMS": "{}",
        "KVTETHER_LOG_LEVEL": "info", "KVTETHER_LIMITS": "{}",
        "KVTETHER_PLUGIN_DEADLINE_MS": "20", "KVTETHER_PLUGIN_ANYTHING": "the plugin's",
        "KVTETHER_INSPECT_TOKEN": "t", "KVTETHER_VENV": ".venv",
        "KVTETHER_TINY_MODEL_DIR": "/tmp", "PATH": "/bin"})


@pytest.mark.parametrize(("auth", "message"), [
    ({"engine_ids": {"orchestrators": ["pod-*"]}},
     "auth: engine_ids: scope 'orchestrators' is not in auth.engine_scopes"),
    ({"engine_ids": {"engines": []}},
     "auth: engine_ids: scope 'engines': list at least one engine id or pattern, none empty"),
    ({"read_scopes": ["operators"]},
     "auth: read_scopes: scope 'operators' has no token in auth.tokens or auth.tokens_file"),
])
def test_auth_settings_name_configured_scopes(auth: dict[str, object], message: str) -> None:
    flags = {"auth": {"tokens": {ENGINE_TOKEN: "engines"}, "engine_scopes": ["engines"],
                      **auth}}
    with pytest.raises(ConfigError) as refused:
        load_config(flags=flags, environ={})
    assert str(refused.value) == message
