"""The release as a user installs it, at the oldest versions pyproject.toml allows.

A wheel is built from the tree with setuptools at the build system's lower bound, then
installed with the daemon's extra into a fresh virtual environment where every declared
requirement is pinned to its lower bound (``>=X`` becomes ``==X``). There ``kvtether
serve`` must start, answer health and stop cleanly on SIGTERM, on the embedded store
and on a real Redis, and the daemon's store and policy tests must pass. The same wheel
must import nothing its requirements do not bring. About a minute, most of it the
installs (from the package index) and the store tests.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.daemon import wait_serving
from tests.support.redis_server import free_port
from tests.support.venvs import installed_versions

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What the build reads: the source tree minus tests, caches and deployment files.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "sidecar", "vllm_plugin")
# The daemon's tests that exercise its dependencies' APIs: Redis (server and cluster),
# pydantic and its settings, the policies, prometheus_client.
DAEMON_TESTS = ("tests/integration/test_store.py", "tests/unit/test_registry.py",
                "tests/unit/test_policy_contract.py", "tests/unit/test_embedded_store.py",
                "tests/unit/test_job_tracker.py", "tests/unit/test_decision_log.py")
# Test runners, not kvtether's requirements: installed under the same constraints, so
# they cannot move a pinned requirement.
TEST_RUNNER = ("pytest", "pytest-asyncio", "pytest-timeout", "hypothesis")

pytestmark = pytest.mark.timeout(600)


def declared_requirements() -> list[Requirement]:
    """The build system's, the base install's and the daemon extra's requirements."""
    texts = [*PYPROJECT["build-system"]["requires"], *PYPROJECT["project"]["dependencies"],
             *PYPROJECT["project"]["optional-dependencies"]["daemon"]]
    return [Requirement(text) for text in texts]


def lower_bound(requirement: Requirement) -> str:
    (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return bound


def floors() -> dict[str, str]:
    """Each declared distribution → its lower bound."""
    return {canonicalize_name(req.name): lower_bound(req) for req in declared_requirements()}


def test_every_requirement_has_one_lower_bound() -> None:
    for requirement in declared_requirements():
        operators = [spec.operator for spec in requirement.specifier]
        assert operators.count(">=") == 1, (
            f"{requirement}: the lowest-versions install pins one `>=` bound per requirement")


def _run(*argv: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(arg) for arg in argv], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout_s)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would change the install or the daemon."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("KVTETHER_", "PIP_CONSTRAINT", "PYTHON"))}
    return {**env, **extra}


@pytest.fixture(scope="module")
def lowest(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, a virtual environment with it and its daemon extra installed
    at the lower bounds)."""
    base = tmp_path_factory.mktemp("lowest")
    constraints = base / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n"
                                   for name, version in floors().items()))
    source = base / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(ROOT / name, source / name)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = (venv / "bin" / "python", "-m", "pip", "--disable-pip-version-check")
    # PIP_CONSTRAINT reaches the isolated build environment too: setuptools at its floor.
    env = _clean_env(PIP_CONSTRAINT=str(constraints))
    built = _run(*pip, "wheel", "--no-deps", "-w", base / "dist", source, env=env)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (base / "dist").glob("kvtether-*.whl")
    installed = _run(*pip, "install", "-q", f"{wheel}[daemon]", *TEST_RUNNER, env=env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return wheel, venv


def test_the_install_is_at_every_lower_bound(lowest: tuple[Path, Path]) -> None:
    _wheel, venv = lowest
    installed = installed_versions(venv / "bin" / "python", env=_clean_env())
    build_system = {canonicalize_name(Requirement(text).name)
                    for text in PYPROJECT["build-system"]["requires"]}
    off_floor = {name: installed.get(name) for name, bound in floors().items()
                 if name not in build_system
                 and (name not in installed or Version(installed[name]) != Version(bound))}
    assert not off_floor, f"installed above (or without) their lower bound: {off_floor}"


def test_version_flag_names_the_release(lowest: tuple[Path, Path]) -> None:
    _wheel, venv = lowest
    done = _run(venv / "bin" / "kvtether", "--version", env=_clean_env(), cwd=venv)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvtether {PYPROJECT['project']['version']}\n"


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_serve_answers_health_and_stops_cleanly(lowest: tuple[Path, Path], store: str,
                                                request: pytest.FixtureRequest) -> None:
    _wheel, venv = lowest
    port, metrics_port = free_port(), free_port()
    args = ["--listen", f"127.0.0.1:{port}", "--metrics-port", str(metrics_port)]
    if store == "redis":
        args += ["--redis-url", request.getfixturevalue("clean_redis")]
    # Run from the environment's folder: the wheel's code, not the source tree's.
    process = subprocess.Popen([str(venv / "bin" / "kvtether"), "serve", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=_clean_env(), cwd=venv)
    try:
        wait_serving(f"127.0.0.1:{port}", process=process)
        exposition = urllib.request.urlopen(
            f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        version = PYPROJECT["project"]["version"]
        python = platform.python_version()
        assert (f'kvtether_build_info{{python="{python}",version="{version}"}} 1.0'
                in exposition)
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert process.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "daemon_stopped" in err, err[-3000:]


def test_the_daemons_tests_pass_at_the_lower_bounds(lowest: tuple[Path, Path],
                                                    redis_url: str) -> None:
    _wheel, venv = lowest
    # The pytest script (not `python -m`, which puts the working folder first) and
    # --import-mode=append: the installed wheel's packages come before the tree's.
    done = _run(venv / "bin" / "pytest", "-q", "-p", "no:cacheprovider",
                "--import-mode=append", "-x", *DAEMON_TESTS,
                env=_clean_env(REDIS_URL=redis_url), cwd=ROOT, timeout_s=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


# --- what the wheel imports ------------------------------------------------------------

# Imports allowed beyond the base install and the daemon extra, by module prefix: the
# engine plugin runs inside vLLM's process (vLLM, and the tokenizers vLLM requires), and
# the stub generator needs the stubgen extra.
EXTRA_IMPORTS = {"vllm_plugin/": {"vllm", "transformers"},
                 "sidecar/api/generate.py": {"grpc_tools"}}


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imported_top_level_names(source: bytes) -> set[str]:
    """Absolute imports a module runs (anywhere in it, lazy ones included; not those
    under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        if not _under_type_checking(node, parents):
            names |= {module.partition(".")[0] for module in modules}
    return names


def test_the_wheel_imports_only_what_its_requirements_bring(
        lowest: tuple[Path, Path]) -> None:
    wheel, venv = lowest
    # The import names each installed distribution provides, read in the environment.
    probe = ("import json, importlib.metadata as m; "
             "print(json.dumps(m.packages_distributions()))")
    done = _run(venv / "bin" / "python", "-c", probe, env=_clean_env(), cwd=venv)
    provided: dict[str, list[str]] = json.loads(done.stdout)
    declared = set(floors()) | {canonicalize_name(extra)
                                for req in declared_requirements() for extra in req.extras}
    requirements = {name for name, dists in provided.items()
                    if declared & {canonicalize_name(dist) for dist in dists}}
    allowed = set(sys.stdlib_module_names) | {"sidecar", "vllm_plugin"} | requirements
    undeclared = {}
    with zipfile.ZipFile(wheel) as archive:
        modules = [name for name in archive.namelist() if name.endswith(".py")]
        assert "sidecar/cli.py" in modules and "vllm_plugin/__init__.py" in modules
        for module in modules:
            extra = set().union(*(names for prefix, names in EXTRA_IMPORTS.items()
                                  if module.startswith(prefix)))
            unknown = _imported_top_level_names(archive.read(module)) - allowed - extra
            if unknown:
                undeclared[module] = sorted(unknown)
    assert not undeclared, f"modules importing what no requirement brings: {undeclared}"
