"""No import cycles, between modules or between packages, and no product test leans on
the benchmarks.

The graph is read from the source (``ast``), so an import inside a function counts as
much as one at the top: a cycle through a lazy import still means neither side can be
understood, tested or moved without the other. Imports under ``if TYPE_CHECKING:`` are
left out: they never run, and they are how a type annotation names its way back.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sidecar", "vllm_plugin", "benchmarks")
# Generated code: protoc's stubs import each other by their own rules.
GENERATED = ("sidecar/api/kvtether/",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            for other in node.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _import_nodes(node)


def imported_modules(path: Path, known: set[str], here: str | None = None) -> set[str]:
    """The modules of ``known`` that the file at ``path`` (module ``here``) imports."""
    here = here or module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b`` imports the module a.b when there is one, else a's name b.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        for target in targets:
            # ``import a.b.c`` where only a.b is ours (or a.b.c is a name in a.b).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != here:
                found.add(target)
    return found


def source_files(roots: Iterable[str]) -> list[Path]:
    return sorted(path for root in roots for path in (ROOT / root).rglob("*.py")
                  if not str(path.relative_to(ROOT)).startswith(GENERATED))


def module_graph() -> dict[str, set[str]]:
    files = source_files(PACKAGES)
    known = {module_name(path) for path in files}
    return {module_name(path): imported_modules(path, known) for path in files}


def package_of(module: str) -> str:
    """The unit a package-level cycle is counted between: ``sidecar.runtime`` for
    everything under sidecar/runtime/, ``sidecar.cli`` for a top-level module."""
    return ".".join(module.split(".")[:2])


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in modules.items():
        edges = packages.setdefault(package_of(module), set())
        edges.update(package_of(target) for target in targets)
    for package, edges in packages.items():
        edges.discard(package)
    return packages


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the path ``[a, b, ..., a]``, or None when it has none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph.get(start, ())))]
        while stack:
            following = next(stack[-1], None)
            if following is None:
                stack.pop()
                finished = path.pop()
                done.add(finished)
                on_path.discard(finished)
                continue
            if following in on_path:
                return [*path[path.index(following):], following]
            if following in done:
                continue
            path.append(following)
            on_path.add(following)
            stack.append(iter(sorted(graph.get(following, ()))))
    return None


def test_find_cycle_names_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_a_function_level_import_counts_and_type_checking_does_not(tmp_path: Path) -> None:
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from sidecar.runtime import decider\n"
              "else:\n    import sidecar.store\n"
              "def late() -> None:\n    from sidecar.telemetry.metrics import REGISTRY\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    known = {"sidecar", "sidecar.runtime", "sidecar.runtime.decider", "sidecar.store",
             "sidecar.telemetry", "sidecar.telemetry.metrics"}
    assert imported_modules(path, known, here="sidecar.probe") == {
        "sidecar.store", "sidecar.telemetry.metrics"}


def test_no_module_imports_itself_back() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle or [])


def test_no_package_imports_itself_back() -> None:
    cycle = find_cycle(package_graph(module_graph()))
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_product_tests_do_not_import_benchmarks() -> None:
    """A test of the product checks the product: a helper it needs lives in tests/support
    or in the product, not in a benchmark whose code changes with its experiments. The
    benchmarks' own tests live in tests/benchmarks/."""
    known = {module_name(path) for path in source_files(["benchmarks"])}
    borrowing = {str(path.relative_to(ROOT)): sorted(imported_modules(path, known))
                 for path in source_files(["tests"])
                 if path.relative_to(ROOT).parts[:2] != ("tests", "benchmarks")}
    offenders = [f"{path} imports {', '.join(names)}" for path, names in borrowing.items()
                 if names]
    assert not offenders, "\n".join(offenders)
