"""The docs that list the policies list the ones the registry has: a policy added to
sidecar/policies/registry.py and missing from a list (or one listed and never
registered) fails here, naming the doc."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from sidecar.policies.registry import available_policies

ROOT = Path(__file__).resolve().parents[2]
BACKTICKED = re.compile(r"`([a-z][a-z-]*)`")


def _table_row(path: Path, first_cell: str) -> str:
    (row,) = [line for line in path.read_text().splitlines()
              if line.startswith(f"| {first_cell} |")]
    return row


def test_operations_and_the_charts_readme_list_every_registered_policy() -> None:
    registered = set(available_policies())
    for path, first_cell in ((ROOT / "docs" / "operations.md", "`policy.name`"),
                             (ROOT / "deploy" / "helm" / "kvtether" / "README.md",
                              "`daemon.policy.name`")):
        meaning = _table_row(path, first_cell).rstrip(" |").rsplit("|", 1)[1]
        listed = set(BACKTICKED.findall(meaning))
        assert listed == registered, (
            f"{path.relative_to(ROOT)}: {first_cell} lists {sorted(listed)}, the registry "
            f"has {sorted(registered)}")


def test_architecture_links_every_policys_readme() -> None:
    path = ROOT / "docs" / "architecture.md"
    linked = {match[1] for match in re.finditer(
        r"\[([a-z-]+)\]\(\.\./sidecar/policies/\w+/README\.md\)", path.read_text())}
    assert linked == set(available_policies()), (
        f"docs/architecture.md links the READMEs of {sorted(linked)}, the registry has "
        f"{sorted(available_policies())}")
    for name in available_policies():
        readme = ROOT / "sidecar" / "policies" / name.replace("-", "_") / "README.md"
        assert readme.is_file(), f"{name} has no README at {readme.relative_to(ROOT)}"


def test_policies_md_has_a_section_per_policy() -> None:
    sections = re.findall(r"^## `([a-z-]+)`$", (ROOT / "docs" / "policies.md").read_text(),
                          re.MULTILINE)
    assert sections == list(available_policies()), sections


def _shipped_continuum_params() -> dict[str, dict[str, object]]:
    compose = yaml.safe_load((ROOT / "deploy" / "config" / "kvtether.yaml").read_text())
    configmap = yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text())
    kubernetes = yaml.safe_load(configmap["data"]["kvtether.yaml"])
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "kvtether" / "values.yaml").read_text())
    return {"deploy/config/kvtether.yaml": compose["policy"]["params"],
            "deploy/k8s/configmap.yaml": kubernetes["policy"]["params"],
            "deploy/helm/kvtether/values.yaml": chart["daemon"]["policy"]["params"]["continuum"]}


def test_shipped_configs_use_continuums_ttl_mode_as_policies_md_advises() -> None:
    """docs/policies.md: `fixed` is the default; `cdf` needs prefill_s_per_token set for
    the model and GPU (its default is Llama-3.1-8B on an RTX 5090, not the shipped
    Qwen2.5-1.5B on whatever GPU runs it)."""
    doc = (ROOT / "docs" / "policies.md").read_text()
    assert "`fixed` mode (the default)" in doc and "`cdf` mode needs `prefill_s_per_token`" in doc
    for path, params in _shipped_continuum_params().items():
        mode = params.get("ttl_mode", "fixed")
        assert mode == "fixed" or "prefill_s_per_token" in params, (
            f"{path}: ttl_mode {mode} with the default prefill_s_per_token")
