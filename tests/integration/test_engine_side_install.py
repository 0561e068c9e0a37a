"""kvtether with no extra, as a vLLM image takes it: the engine side's own small
dependency set, at the oldest protobuf vLLM accepts.

A fresh virtual environment gets ``protobuf==5.29.6`` (vLLM 0.33's floor) and this
tree with no extra. The install must resolve, bring none of the daemon's stack, and the
plugin's and the shared layer's tests must pass there, stubs included. vLLM itself is
not installed: its CPU wheel is large, and the plugin's tests here need only its shape.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.venvs import installed_versions

ROOT = Path(__file__).resolve().parents[2]
PROTOBUF_FLOOR = "5.29.6"
# Distributions only the daemon needs (the `daemon` extra).
DAEMON_STACK = {"redis", "hiredis", "structlog", "prometheus-client", "pydantic",
                "pydantic-settings", "pyyaml", "grpcio-reflection", "grpcio-health-checking"}
# The engine side's tests: the plugin's pure parts, the stubs and the shared rules.
ENGINE_SIDE_TESTS = ("tests/unit/test_chains.py", "tests/unit/test_plugin_metadata.py",
                     "tests/unit/test_plugin_fallback.py", "tests/unit/test_retention_rules.py",
                     "tests/unit/test_toolcalls.py", "tests/unit/test_request_fields.py",
                     "tests/unit/test_layering.py::"
                     "test_importing_the_plugin_loads_none_of_the_daemons_stack")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engine_side_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("engine-side") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"protobuf=={PROTOBUF_FLOOR}", str(ROOT),
         # The test runner, not kvtether's: these tests use it.
         "pytest", "pytest-asyncio", "pytest-timeout", "hypothesis"],
        capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def test_the_engine_side_install_brings_no_daemon_stack(engine_side_python: Path) -> None:
    installed = installed_versions(engine_side_python)
    assert installed["protobuf"] == PROTOBUF_FLOOR
    assert "kvtether" in installed and "grpcio" in installed
    assert DAEMON_STACK.isdisjoint(installed), sorted(DAEMON_STACK & installed.keys())


def test_the_plugin_tests_pass_at_the_protobuf_floor(engine_side_python: Path) -> None:
    done = subprocess.run(
        [str(engine_side_python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--noconftest", "-W", "error::UserWarning", *ENGINE_SIDE_TESTS],
        capture_output=True, text=True, cwd=ROOT, timeout=540,
        env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_the_daemon_command_names_the_extra(engine_side_python: Path) -> None:
    kvtether = engine_side_python.parent / "kvtether"
    done = subprocess.run([str(kvtether), "serve"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "pip install '.[daemon]'" in done.stderr
