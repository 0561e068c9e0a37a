"""Daemon configuration: load → complete → validate, then log it (llm-d sidecar style).

Sources, later ones winning: built-in defaults < YAML file (``--config``) <
``KVTETHER_*`` environment (nested with ``__``, e.g. ``KVTETHER_POLICY__NAME``) <
command-line flags. Anything wrong stops the daemon at start-up with one line naming
the problem (:class:`ConfigError`), a ``KVTETHER_*`` variable that sets nothing
included; nothing is silently replaced by a default.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from sidecar.api.bounds import MAX_ID_CHARS

ENV_PREFIX = "KVTETHER_"


class ConfigError(ValueError):
    """Bad configuration; the message is one line naming the problem. ``setting`` is
    the dotted key at fault (``log_format``, ``metrics.port``), when one is."""

    def __init__(self, message: str, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyConfig(_Section):
    name: str = Field("continuum", description="Registered policy name (see `kvtether policies`).")
    params: dict[str, Any] = Field(default_factory=dict, description="The policy's parameters.")


class ListenConfig(_Section):
    # host:port for gRPC over TCP; empty disables TCP.
    tcp: str = "127.0.0.1:50051"
    # Path of a Unix socket for gRPC; empty disables it.
    unix_socket: str = ""
    # host:port serving Inspect (read-only) on its own, e.g. for operators only;
    # empty serves Inspect on the main listeners.
    inspect_tcp: str = ""
    # Permissions of the socket file, octal: group read-write lets a sidecar's peer
    # container (same fsGroup, another uid) connect.
    unix_socket_mode: str = "0660"

    @field_validator("unix_socket_mode")
    @classmethod
    def _octal_mode(cls, value: str) -> str:
        try:
            mode = int(value, 8)
        except ValueError:
            raise ValueError(f"expected an octal mode like 0660, got {value!r}") from None
        if not 0 <= mode <= 0o777:
            raise ValueError(f"expected an octal mode like 0660, got {value!r}")
        return value

    @field_validator("tcp", "inspect_tcp")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(f"expected host:port, got {value!r}")
        return value


class TlsConfig(_Section):
    """TLS on the TCP listeners (the Unix socket relies on file permissions).
    ``client_ca_file`` turns on mutual TLS: clients must present a certificate signed
    by that CA (engines and orchestrators alike)."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    @model_validator(mode="after")
    def _complete(self) -> TlsConfig:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("set both cert_file and key_file, or neither")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("client_ca_file (mutual TLS) needs cert_file and key_file")
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"{name}: cannot read {path!r}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


class LimitsConfig(_Section):
    # Calls per second allowed per caller (the token's scope; the client's address
    # without tokens), with this burst; beyond: RESOURCE_EXHAUSTED. Retention: every
    # call. Engine: a Session stream opened or a unary Step (an engine opens one
    # stream and keeps it). Inspect: every call, a WatchDecisions stream included.
    retention_calls_per_s: float = Field(50.0, gt=0)
    retention_burst: int = Field(100, ge=1)
    # High: one caller may stand for many engines (with tokens, a scope shared by a
    # fleet reconnecting at once; a replay or test tool driving engines by unary Step).
    engine_calls_per_s: float = Field(1000.0, gt=0)
    engine_burst: int = Field(2000, ge=1)
    inspect_calls_per_s: float = Field(50.0, gt=0)
    inspect_burst: int = Field(100, ge=1)
    # Takeovers of one engine id (a Session's snapshot ending the live Session that
    # holds the id) a minute, with this burst; beyond: RESOURCE_EXHAUSTED, and the
    # live Session keeps the id. A restarting engine takes its id over once.
    engine_takeovers_per_min: float = Field(6.0, gt=0)
    engine_takeover_burst: int = Field(3, ge=1)
    # Inspect/WatchDecisions streams open at once; beyond: RESOURCE_EXHAUSTED.
    max_watchers: int = Field(64, ge=1)
    # Decision records sent a second to all watchers together: each send costs the
    # event loop that answers engines. A watcher that falls behind is dropped.
    watch_records_per_s: float = Field(2000.0, gt=0)
    # The most running requests, waiting requests and pins one engine's reports may
    # hold: a snapshot (or a delta that would make the engine's mirror) past one is
    # refused with RESOURCE_EXHAUSTED naming it. Far above a real engine: vLLM's
    # max_num_seqs is 256 or 1,024 by default. The gRPC transport takes messages up to
    # the largest report these allow (sidecar.server.app.max_message_bytes).
    max_running_per_engine: int = Field(2048, ge=1)
    max_waiting_per_engine: int = Field(8192, ge=1)
    max_pins_per_engine: int = Field(8192, ge=1)


class MetricsConfig(_Section):
    host: str = "127.0.0.1"
    # Port of the Prometheus /metrics endpoint; 0 picks a free port, -1 disables it.
    port: int = Field(9400, ge=-1, le=65535)


class StoreConfig(_Section):
    # redis://[user:password@]host:port/db, or redis+cluster://host:port for Redis
    # Cluster (see sidecar/store/redis_url.py); unset runs on the embedded store.
    redis_url: str | None = None
    timeout_s: float = Field(2.0, gt=0)
    # Per-job history: newest events kept, and how long an idle job's history lives.
    history_max_events: int = Field(256, ge=1)
    history_ttl_s: float = Field(24 * 3600.0, gt=0)
    # Tool-time statistics live this long after their last update.
    tool_stats_ttl_s: float = Field(7 * 24 * 3600.0, gt=0)
    # The embedded store keeps at most this many job histories and tool statistics
    # (together), dropping the least recently written first. Redis bounds them by
    # the TTLs above (and its maxmemory policy).
    embedded_max_histories: int = Field(50_000, ge=1)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value:
            from sidecar.store.redis_url import parse_redis_url

            parse_redis_url(value)  # ValueError naming the problem, password redacted
        return value or None


MIN_TOKEN_CHARS = 16


def _check_tokens(tokens: Mapping[str, Any], source: str) -> dict[str, str]:
    # Messages name the scope, never the token: they end up in logs.
    checked: dict[str, str] = {}
    for token, scope in tokens.items():
        if not isinstance(token, str) or not isinstance(scope, str):
            raise ValueError(f"{source}: tokens and scopes must be strings")
        if not scope or len(scope) > MAX_ID_CHARS:
            raise ValueError(f"{source}: scope {scope[:32]!r} must have 1-{MAX_ID_CHARS} "
                             "characters")
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{source}: the token of scope {scope!r} is shorter than "
                             f"{MIN_TOKEN_CHARS} characters")
        if not all(33 <= ord(char) <= 126 for char in token):
            raise ValueError(f"{source}: the token of scope {scope!r} must be printable "
                             "ASCII without spaces")
        checked[token] = scope
    return checked


class AuthConfig(_Section):
    """Authenticated scopes: each bearer token (gRPC metadata
    ``authorization: Bearer <token>``) maps to the scope it acts as. None configured:
    callers' scopes are claimed, not authenticated (a warning at start-up), and
    engines report without a token.

    With tokens, an engine reports steps (EngineSession) only with a token whose
    scope ``engine_scopes`` lists, for the engine ids ``engine_ids`` gives that scope
    (any id where it gives none); the other scopes are orchestrators' (Retention).
    Reading (Inspect, Retention/GetDirectives) takes a token of a ``read_scopes``
    scope (any scope's where none is listed), unless ``inspect_open``."""

    tokens: dict[str, str] = Field(default_factory=dict)
    # A YAML (or JSON) mapping of token to scope, e.g. a mounted secret.
    tokens_file: Path | None = None
    # The scopes whose tokens may report engine steps (the plugin's
    # KVTETHER_PLUGIN_TOKEN); each needs a token above.
    engine_scopes: tuple[str, ...] = ()
    # Engine scope -> the engine ids its tokens may report for, as shell-style
    # patterns (fnmatch: "vllm-0", "gpu-pool-*"). A scope not listed: any id.
    engine_ids: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    # The scopes whose tokens may read (Inspect, Retention/GetDirectives); empty:
    # every scope's. Only with tokens configured.
    read_scopes: tuple[str, ...] = ()
    # True: reading needs no token even with tokens configured (still rate-limited).
    inspect_open: bool = False

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_tokens(value, "tokens")

    @model_validator(mode="after")
    def _complete(self) -> AuthConfig:
        scopes = set(self.token_scopes().values())  # a bad or unreadable file fails here
        for scope in self.engine_scopes:
            if scope not in scopes:
                raise ValueError(f"engine_scopes: scope {scope[:32]!r} has no token in "
                                 "auth.tokens or auth.tokens_file")
        if scopes and not self.engine_scopes:
            raise ValueError("engine_scopes: list the scope(s) whose tokens engines report "
                             "with: with auth tokens set, an engine needs one "
                             "(KVTETHER_PLUGIN_TOKEN)")
        for scope, patterns in self.engine_ids.items():
            if scope not in self.engine_scopes:
                raise ValueError(f"engine_ids: scope {scope[:32]!r} is not in "
                                 "auth.engine_scopes")
            if not patterns or not all(patterns):
                raise ValueError(f"engine_ids: scope {scope[:32]!r}: list at least one "
                                 "engine id or pattern, none empty")
        for scope in self.read_scopes:
            if scope not in scopes:
                raise ValueError(f"read_scopes: scope {scope[:32]!r} has no token in "
                                 "auth.tokens or auth.tokens_file")
        return self

    def token_scopes(self) -> dict[str, str]:
        """Every configured token and its scope (``tokens`` and ``tokens_file``)."""
        merged = dict(self.tokens)
        if self.tokens_file is not None:
            try:
                data = yaml.safe_load(self.tokens_file.read_text())
            except OSError as error:
                raise ValueError(f"tokens_file {self.tokens_file}: "
                                 f"{error.strerror or error}") from error
            except yaml.YAMLError as error:
                raise ValueError(f"tokens_file {self.tokens_file}: malformed YAML") from error
            if not isinstance(data, dict) or not data:
                raise ValueError(f"tokens_file {self.tokens_file}: expected a mapping of "
                                 "token to scope")
            for token, scope in _check_tokens(data, f"tokens_file {self.tokens_file}").items():
                if merged.get(token, scope) != scope:
                    raise ValueError(f"tokens_file {self.tokens_file}: a token maps to "
                                     f"{merged[token]!r} in tokens and {scope!r} here")
                merged[token] = scope
        return merged


class DaemonConfig(BaseSettings):
    """Everything `kvtether serve` needs; every field has a working default."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True
    )

    policy: PolicyConfig = PolicyConfig()
    listen: ListenConfig = ListenConfig()
    metrics: MetricsConfig = MetricsConfig()
    store: StoreConfig = StoreConfig()
    auth: AuthConfig = AuthConfig()
    tls: TlsConfig = TlsConfig()
    limits: LimitsConfig = LimitsConfig()
    # SIGTERM: health flips to NOT_SERVING, then in-flight calls get this long to finish.
    grace_s: float = Field(5.0, ge=0)
    log_level: str = "info"
    # "json": one JSON object a line, for log shippers; "console": key=value text, for
    # a person at a terminal.
    log_format: str = "json"
    # Most jobs tracked in memory; the least recently active are forgotten first.
    max_jobs_tracked: int = Field(100_000, ge=1)
    # An engine with no open session that has neither reported nor left for this long
    # is forgotten: its learned step cost, the policy's state for it, its metric
    # series. Shorter absences (a dropped connection, a restart under the same id)
    # keep them.
    engine_forget_after_s: float = Field(600.0, gt=0)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.lower() not in {"debug", "info", "warning", "error"}:
            raise ValueError(f"expected debug, info, warning or error, got {value!r}")
        return value.lower()

    @field_validator("log_format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value.lower() not in {"json", "console"}:
            raise ValueError(f"expected json or console, got {value!r}")
        return value.lower()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"config file {path}: {error.strerror or error}") from error
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise ConfigError(f"config file {path}{where}: malformed YAML: {problem}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return data


def _describe(error: ValidationError) -> ConfigError:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown setting"
    return ConfigError(f"{where or 'config'}: {message}", where)


# KVTETHER_* variables that are not the daemon's settings: the plugin's (checked by the
# plugin, vllm_plugin/settings.py: a daemon may share an environment with an engine),
# `kvtether inspect`'s token, and those of the repository's scripts and tests (the
# conformance run's, scripts/conformance.py, by prefix).
OTHER_PREFIXES = ("KVTETHER_PLUGIN_", "KVTETHER_CONFORMANCE")
OTHER_VARIABLES = frozenset({
    "KVTETHER_INSPECT_TOKEN",
    "KVTETHER_VENV", "KVTETHER_VLLM_MATRIX", "KVTETHER_TINY_MODEL_DIR",
    "KVTETHER_ENGINE_PYTHON", "KVTETHER_ENGINE_FORCE", "KVTETHER_ALLOW_SYSTEM_PYTHON",
    "KVTETHER_E2E_DEADLINE_MS",
})


def _sections() -> dict[str, type[BaseModel]]:
    """The configuration's sections (``policy``, ``auth``, ...) by upper-case name."""
    return {name.upper(): field.annotation for name, field in DaemonConfig.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)}


def daemon_variables() -> list[str]:
    """Every variable that sets one of the daemon's settings: each top-level key, each
    section whole (JSON) and each key of a section."""
    names = [ENV_PREFIX + name.upper() for name in DaemonConfig.model_fields]
    for section, model in _sections().items():
        names += [f"{ENV_PREFIX}{section}__{key.upper()}" for key in model.model_fields]
    return names


def check_environment(environ: Mapping[str, str]) -> None:
    """Raise ConfigError for a ``KVTETHER_*`` variable that sets nothing: pydantic-settings
    reads only the names of settings, so a misspelt one (``KVTETHER_POLCY__NAME``,
    ``KVTETHER_AUTH_TOKENS``) would otherwise leave its setting at the default, unnoticed.
    Keys inside a section (``KVTETHER_AUTH__TOKENZ``) are the section's to refuse."""
    known = daemon_variables()
    sections = _sections()
    for variable in sorted(environ):
        name = variable.upper()  # pydantic-settings matches names case-insensitively
        if (not name.startswith(ENV_PREFIX) or name.startswith(OTHER_PREFIXES)
                or name in OTHER_VARIABLES):
            continue
        head, nested, _rest = name.removeprefix(ENV_PREFIX).partition("__")
        if ENV_PREFIX + head in known and (not nested or head in sections):
            continue
        # Matched without the prefix, which every name shares.
        nearest = difflib.get_close_matches(name.removeprefix(ENV_PREFIX),
                                            [known_name.removeprefix(ENV_PREFIX)
                                             for known_name in known], n=1)
        hint = (f"did you mean {ENV_PREFIX}{nearest[0]}?" if nearest
                else "see the daemon settings in docs/operations.md")
        raise ConfigError(f"{variable}: unknown variable; {hint}")


def load_config(path: Path | None = None, flags: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """Load and validate; raise ConfigError with one line naming the first problem.
    ``environ``: the environment to check for misspelt ``KVTETHER_*`` names (the
    process's by default; the settings themselves are read from the process's).

    The policy name and parameters are validated separately by
    ``sidecar.policies.registry.build_policy`` when the daemon starts, and the Redis
    URL by connecting to it: both stop the daemon with one line too.
    """
    check_environment(os.environ if environ is None else environ)
    file_values = _read_yaml(path) if path is not None else {}

    class _Loaded(DaemonConfig):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            # First wins, deep-merged: flags, then KVTETHER_* environment, then the file.
            return (
                init_settings,
                env_settings,
                InitSettingsSource(settings_cls, init_kwargs=file_values),
            )

    try:
        return _Loaded(**dict(flags or {}))
    except ValidationError as error:
        raise _describe(error) from error
    except SettingsError as error:
        raise ConfigError(f"environment: {error}") from error


def as_log_fields(config: DaemonConfig) -> dict[str, Any]:
    """Flat key-values for the start-up log line, with secrets redacted."""
    from sidecar.store.redis_store import _redact

    fields: dict[str, Any] = {}
    for section, values in config.model_dump().items():
        if isinstance(values, dict):
            for key, value in values.items():
                fields[f"{section}.{key}"] = value
        else:
            fields[section] = values
    if fields.get("store.redis_url"):
        fields["store.redis_url"] = _redact(fields["store.redis_url"])
    # Tokens are secrets: log only which scopes they authenticate.
    fields["auth.tokens"] = sorted(set(config.auth.tokens.values()))
    return fields
