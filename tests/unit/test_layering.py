"""The framework stays a contract and policies stay pure: no gRPC, no Redis, no runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_FOR_PURE_CODE = ("grpc", "redis", "sidecar.store", "sidecar.server",
                           "sidecar.runtime", "sidecar.api", "prometheus_client")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["sidecar/framework", "sidecar/policies"])
def test_pure_packages_import_no_runtime(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for path in files:
        bad = sorted(name for name in _imports(path)
                     if name.startswith(FORBIDDEN_FOR_PURE_CODE))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_framework_imports_nothing_of_the_implementation() -> None:
    for path in sorted((ROOT / "sidecar/framework").rglob("*.py")):
        own = {name for name in _imports(path)
               if name.startswith("sidecar.") and not name.startswith("sidecar.framework")}
        assert not own, f"{path.relative_to(ROOT)} imports {own}"


def test_importing_every_policy_loads_no_store_or_network() -> None:
    import subprocess
    import sys

    probe = (
        "import sys; import sidecar.policies.registry as r; "
        "[r.build_policy(n, {}) for n in r.available_policies()]; "
        "bad = [m for m in sys.modules if m.startswith(('redis', 'grpc', 'sidecar.store'))]; "
        "print(','.join(bad))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == ""
