"""The daemon's log stream: the standard library's loggers (asyncio, grpc, redis) and
kvtether's structlog loggers come out in one format, each line naming its logger;
``--log-format`` picks JSON or console text."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest
import structlog

from sidecar.cli import main
from sidecar.config import load_config
from sidecar.telemetry.logging import configure_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """configure_logging changes process-wide state: put it back for the next test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    try:
        yield
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = handlers, level
        structlog.configure(**config)


def _emit_from_every_source() -> None:
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        # What asyncio's default exception handler does with a task's lost exception.
        logging.getLogger("asyncio").error("Task exception was never retrieved",
                                           exc_info=True)
    logging.getLogger("redis.connection").warning("reconnecting to %s", "127.0.0.1:6379")
    log = structlog.get_logger("kvtether.store")
    log.info("store_connected", backend="redis", timeout_s=2.0)
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        log.exception("history_write_failed", job_id="job-7")
    warnings.warn("old option", DeprecationWarning, stacklevel=1)


def test_json_lines_from_stdlib_and_structlog_name_their_logger(restored_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        _emit_from_every_source()

    lines = stream.getvalue().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert len(records) == 5
    for record in records:
        assert {"timestamp", "level", "logger", "event"} <= record.keys(), record
        assert not any(key.startswith("_") for key in record), record
    asyncio_error, redis_warning, connected, failed, warned = records
    assert (asyncio_error["logger"], asyncio_error["level"]) == ("asyncio", "error")
    assert asyncio_error["event"] == "Task exception was never retrieved"
    assert "ConnectionResetError: peer went away" in asyncio_error["exception"]
    assert redis_warning == {**redis_warning, "logger": "redis.connection",
                             "level": "warning", "event": "reconnecting to 127.0.0.1:6379"}
    assert connected == {**connected, "logger": "kvtether.store", "level": "info",
                         "event": "store_connected", "backend": "redis", "timeout_s": 2.0}
    assert (failed["logger"], failed["level"], failed["job_id"]) == \
        ("kvtether.store", "error", "job-7")
    assert "ZeroDivisionError" in failed["exception"]
    assert (warned["logger"], warned["level"]) == ("py.warnings", "warning")
    assert "DeprecationWarning: old option" in warned["event"]


def test_the_level_drops_stdlib_and_structlog_events_alike(restored_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("warning", "json", stream=stream)
    logging.getLogger("grpc._server").info("serving")
    structlog.get_logger("kvtether.daemon").info("daemon_serving")
    structlog.get_logger("kvtether.daemon").warning("store_unreachable")
    assert [json.loads(line)["event"] for line in stream.getvalue().splitlines()] == \
        ["store_unreachable"]


def test_console_format_is_one_readable_line_with_the_logger(restored_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("info", "console", stream=stream)
    structlog.get_logger("kvtether.daemon").info("daemon_serving", policy="adaptive")
    try:
        raise TimeoutError("redis timed out")
    except TimeoutError:
        logging.getLogger("asyncio").error("Task exception was never retrieved",
                                           exc_info=True)

    text = stream.getvalue()
    first, second, *traceback = text.splitlines()
    assert not first.startswith("{")
    assert "daemon_serving" in first and "policy=adaptive" in first
    assert "[kvtether.daemon]" in first and "info" in first
    assert "Task exception was never retrieved" in second and "[asyncio]" in second
    assert "\x1b[" not in text  # no colour codes when the stream is not a terminal
    assert "TimeoutError: redis timed out" in "\n".join(traceback)


def test_log_format_comes_from_the_file_the_environment_and_the_flag(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config().log_format == "json"
    config_file = tmp_path / "kvtether.yaml"
    config_file.write_text("log_format: console\n")
    assert load_config(config_file).log_format == "console"
    monkeypatch.setenv("KVTETHER_LOG_FORMAT", "JSON")
    assert load_config(config_file).log_format == "json"
    assert load_config(config_file, {"log_format": "console"}).log_format == "console"


def test_a_bad_log_format_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["serve", "--log-format", "xml", "--check"]) == 2
    assert capsys.readouterr().err == \
        "kvtether: error: --log-format (log_format): expected json or console, got 'xml'\n"
    # Set elsewhere, the error names the setting the operator wrote.
    monkeypatch.setenv("KVTETHER_LOG_FORMAT", "yaml")
    assert main(["serve", "--check"]) == 2
    assert capsys.readouterr().err == \
        "kvtether: error: log_format: expected json or console, got 'yaml'\n"
