"""The layers stay apart.

- The framework stays a contract and policies stay pure: no gRPC, no Redis, no runtime.
- The engine plugin (``vllm_plugin``) and the daemon (the rest of ``sidecar``) share
  only ``sidecar.api``, which imports the standard library, grpcio and protobuf: the
  plugin runs inside vLLM's engine process, where the daemon's stack is not installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_FOR_PURE_CODE = ("grpc", "redis", "sidecar.store", "sidecar.server",
                           "sidecar.runtime", "sidecar.api", "prometheus_client")
# The shared layer's pure rules, which a policy may apply (no wire, no I/O).
PURE_SHARED_RULES = ("sidecar.api.toolcalls", "sidecar.api.bounds")
SHARED = "sidecar.api"
GENERATED = ROOT / "sidecar" / "api" / "kvtether"
# What the shared layer may import besides the standard library and itself.
SHARED_THIRD_PARTY = ("grpc", "google.protobuf")
# The stub generator is a dev tool run from a source tree; only it uses grpcio-tools.
SHARED_EXCEPTIONS = {"sidecar.api.generate": ("grpc_tools",)}
# The daemon's stack: none of it may load with the plugin.
DAEMON_ONLY_MODULES = ("redis", "structlog", "prometheus_client", "pydantic",
                       "pydantic_settings", "yaml", "grpc_reflection", "grpc_health")
MAX_LINES = 500


def _imports(path: Path, module_level_only: bool = False) -> set[str]:
    """Absolute names ``path`` imports (``from a import b`` gives ``a`` and ``a.b``);
    with ``module_level_only``, not those inside functions (lazy imports)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).rpartition(".")[0] if path.name != "__init__.py" \
        else _module_name(path)
    nodes: list[ast.AST] = []
    if module_level_only:
        stack: list[ast.AST] = list(tree.body)
        while stack:
            node = stack.pop()
            nodes.append(node)
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                stack.extend(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _modules(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    return files


@pytest.mark.parametrize("package", ["sidecar/framework", "sidecar/policies"])
def test_pure_packages_import_no_runtime(package: str) -> None:
    for path in _modules(package):
        bad = sorted(name for name in _imports(path)
                     if name.startswith(FORBIDDEN_FOR_PURE_CODE)
                     and not any(_within(name, rule) for rule in PURE_SHARED_RULES))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_framework_imports_nothing_of_the_implementation() -> None:
    for path in _modules("sidecar/framework"):
        own = {name for name in _imports(path)
               if name.startswith("sidecar.") and not name.startswith("sidecar.framework")}
        assert not own, f"{path.relative_to(ROOT)} imports {own}"


def test_importing_every_policy_loads_no_store_or_network() -> None:
    probe = (
        "import sys; import sidecar.policies.registry as r; "
        "[r.build_policy(n, {}) for n in r.available_policies()]; "
        "bad = [m for m in sys.modules if m.startswith(('redis', 'grpc', 'sidecar.store'))]; "
        "print(','.join(bad))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True, cwd=ROOT)
    assert done.stdout.strip() == ""


def test_the_plugin_imports_only_the_shared_layer_of_sidecar() -> None:
    for path in _modules("vllm_plugin"):
        bad = sorted(name for name in _imports(path)
                     if _within(name, "sidecar") and not _within(name, SHARED)
                     and name != "sidecar")
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_daemon_imports_nothing_of_the_plugin() -> None:
    for path in _modules("sidecar"):
        bad = sorted(name for name in _imports(path) if _within(name, "vllm_plugin"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_shared_layer_imports_only_stdlib_grpc_and_protobuf() -> None:
    shared = [*_modules("sidecar/api"), ROOT / "sidecar" / "__init__.py"]
    for path in shared:
        allowed = SHARED_THIRD_PARTY + SHARED_EXCEPTIONS.get(_module_name(path), ())
        bad = sorted(
            name for name in _imports(path)
            if name.split(".")[0] not in sys.stdlib_module_names
            and not _within(name, SHARED)
            and not any(_within(name, other) for other in allowed)
        )
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def _needs_vllm() -> set[str]:
    """Plugin modules that import vLLM at module level, directly or through another."""
    direct: dict[str, set[str]] = {}
    for path in _modules("vllm_plugin"):
        direct[_module_name(path)] = _imports(path, module_level_only=True)
    needs = {name for name, imports in direct.items()
             if any(_within(i, "vllm") for i in imports)}
    while True:
        more = {name for name, imports in direct.items()
                if name not in needs and imports & needs}
        if not more:
            return needs
        needs |= more


def test_importing_the_plugin_loads_none_of_the_daemons_stack() -> None:
    """Every plugin module vLLM does not load itself, and the shared layer, imported in
    a fresh interpreter: none of the daemon's dependencies is loaded (vLLM brings some
    of them, so the modules that import vLLM are left out; the ast tests cover them)."""
    needs_vllm = _needs_vllm()
    assert "vllm_plugin.scheduler" in needs_vllm
    modules = sorted(
        {_module_name(path) for path in _modules("vllm_plugin")} - needs_vllm
        | {_module_name(path) for path in _modules("sidecar/api")
           if GENERATED not in path.parents})
    assert "vllm_plugin" in modules and "vllm_plugin.link" in modules
    # grpcio's own package imports grpc_tools, grpc_health and grpc_reflection when
    # they are installed (they are not, beside vLLM): what counts is what comes after.
    probe = (
        "import importlib, sys\n"
        "import grpc\n"
        "before = set(sys.modules)\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "import vllm_plugin\n"
        "vllm_plugin.register()\n"
        f"loaded = sorted({{m.split('.')[0] for m in set(sys.modules) - before}} & "
        f"set({(*DAEMON_ONLY_MODULES, 'vllm')!r}))\n"
        "print(','.join(loaded))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing the plugin loaded {done.stdout.strip()}"


def test_no_hand_written_module_is_over_the_line_limit() -> None:
    long = sorted(
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for package in ("sidecar", "vllm_plugin")
        for path in _modules(package)
        if GENERATED not in path.parents
        and (lines := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert not long, f"over {MAX_LINES} lines: {', '.join(long)}"
