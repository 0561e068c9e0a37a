"""Authenticated scopes: the auth configuration (validated at start-up, never logged in
clear) and the bearer-token lookup."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config import ConfigError, as_log_fields, load_config
from sidecar.retention.auth import Authenticator, NotAnEngineScope, Unauthenticated

DYNAMO_TOKEN = "dynamo-0123456789abcdef"
LLMD_TOKEN = "llm-d-fedcba9876543210"
ENGINE_TOKEN = "engine-0123456789abcdef"


def test_tokens_from_the_config_and_a_file_map_to_scopes(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(f'"{LLMD_TOKEN}": llm-d\n')
    config = load_config(None, {"auth": {"tokens": {DYNAMO_TOKEN: "dynamo"},
                                         "tokens_file": str(tokens_file),
                                         "engine_scopes": ["llm-d"]}})
    assert config.auth.token_scopes() == {DYNAMO_TOKEN: "dynamo", LLMD_TOKEN: "llm-d"}
    assert config.auth.engine_scopes == ("llm-d",)


def test_tokens_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_AUTH__TOKENS", f'{{"{DYNAMO_TOKEN}": "dynamo"}}')
    monkeypatch.setenv("KVTETHER_AUTH__ENGINE_SCOPES", '["dynamo"]')
    auth = load_config(None).auth
    assert auth.token_scopes() == {DYNAMO_TOKEN: "dynamo"} and auth.engine_scopes == ("dynamo",)


def test_the_start_up_log_names_scopes_never_tokens() -> None:
    config = load_config(None, {"auth": {"tokens": {DYNAMO_TOKEN: "dynamo",
                                                    ENGINE_TOKEN: "engines"},
                                         "engine_scopes": ["engines"]}})
    fields = as_log_fields(config)
    assert fields["auth.tokens"] == ["dynamo", "engines"]
    assert DYNAMO_TOKEN not in repr(fields)


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"tokens": {"short": "dynamo"}}, "auth.tokens: tokens: the token of scope 'dynamo' is "
                                          "shorter than 16 characters"),
        ({"tokens": {DYNAMO_TOKEN: ""}}, "auth.tokens: tokens: scope '' must have 1-256"),
        ({"tokens": {"has a space 0123456789": "x"}}, "must be printable ASCII without spaces"),
        ({"tokens_file": "/nonexistent/tokens.yaml"}, "auth: tokens_file /nonexistent/tokens"
                                                      ".yaml: No such file or directory"),
        ({"token": {}}, "auth.token: unknown setting"),
        ({"tokens": {DYNAMO_TOKEN: "dynamo"}, "engine_scopes": ["dynamo", "gpu-pool"]},
         "auth: engine_scopes: scope 'gpu-pool' has no token in auth.tokens or "
         "auth.tokens_file"),
        ({"engine_scopes": ["engines"]}, "engine_scopes: scope 'engines' has no token"),
        ({"tokens": {DYNAMO_TOKEN: "dynamo"}}, "auth: engine_scopes: list the scope(s) whose "
                                               "tokens engines report with"),
    ],
)
def test_bad_auth_configuration_stops_the_daemon_naming_it(auth: dict[str, object],
                                                           message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, {"auth": auth})
    assert message in str(refused.value)
    assert DYNAMO_TOKEN not in str(refused.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [("[not, a, mapping]", "expected a mapping of token to scope"),
     ("a: [unclosed", "malformed YAML"),
     (f'"{DYNAMO_TOKEN}": other', "a token maps to 'dynamo' in tokens and 'other' here")],
)
def test_bad_tokens_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"auth": {"tokens": {DYNAMO_TOKEN: "dynamo"},
                                    "tokens_file": str(tokens_file),
                                    "engine_scopes": ["dynamo"]}})


def test_a_bearer_token_authenticates_its_scope() -> None:
    auth = Authenticator({DYNAMO_TOKEN: "dynamo", LLMD_TOKEN: "llm-d"})
    assert auth.enabled and auth.scopes == ["dynamo", "llm-d"]
    assert auth.scope_of([("authorization", f"Bearer {DYNAMO_TOKEN}")]) == "dynamo"
    assert auth.scope_of([("x-other", "1"), ("authorization", f"bearer {LLMD_TOKEN}")]) == "llm-d"
    assert not Authenticator({}).enabled


def test_only_an_engine_scopes_token_reports_engine_steps() -> None:
    auth = Authenticator({DYNAMO_TOKEN: "dynamo", ENGINE_TOKEN: "engines"}, ["engines"])
    assert auth.engine_scope_of([("authorization", f"Bearer {ENGINE_TOKEN}")]) == "engines"
    with pytest.raises(NotAnEngineScope, match="scope 'dynamo' may not report engine steps: "
                                               r"auth.engine_scopes lists \['engines'\]"):
        auth.engine_scope_of([("authorization", f"Bearer {DYNAMO_TOKEN}")])
    with pytest.raises(Unauthenticated, match="authorization: missing"):
        auth.engine_scope_of([])


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ([], "authorization: missing"),
        (None, "authorization: missing"),
        ([("authorization", DYNAMO_TOKEN)], "expected 'Bearer <token>'"),
        ([("authorization", "Basic abc")], "expected 'Bearer <token>'"),
        ([("authorization", "Bearer ")], "expected 'Bearer <token>'"),
        ([("authorization", "Bearer not-a-configured-token")], "unknown token"),
        ([("authorization", f"Bearer {DYNAMO_TOKEN}")] * 2, "sent more than once"),
    ],
)
def test_no_valid_token_is_unauthenticated(metadata: list[tuple[str, str]] | None,
                                           message: str) -> None:
    with pytest.raises(Unauthenticated, match=message) as refused:
        Authenticator({DYNAMO_TOKEN: "dynamo"}).scope_of(metadata)
    assert DYNAMO_TOKEN not in str(refused.value)
