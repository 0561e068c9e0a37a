"""How every benchmark writes its result: one JSON document that says, beside its
figures, what they were measured with and on (:func:`provenance`), since figures from
different commits or machines do not compare."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.common.machine import git_rev, machine


def provenance() -> dict[str, Any]:
    """kvtether's commit, Python, the machine (:func:`machine`) and the UTC time."""
    return {"kvtether_git_rev": git_rev(), "python": platform.python_version(),
            "machine": machine(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def describe_machine(described: Mapping[str, Any] | str) -> str:
    """A result's machine on one line, for a report (older results hold a line already)."""
    if isinstance(described, str):
        return described
    return (f"{described.get('platform', '?')}, {described.get('cpu_model') or 'unknown CPU'}, "
            f"{described.get('cpus', '?')} CPUs, {described.get('memory_gib', '?')} GiB")


def write_json(path: Path, data: Any, compact: bool = False) -> None:
    """``data`` as JSON at ``path``, whole or not at all (written beside it, then moved)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=1)
    staged = path.with_suffix(path.suffix + ".tmp")
    staged.write_text(text + "\n")
    staged.replace(path)


def write_result(path: Path, result: Mapping[str, Any]) -> dict[str, Any]:
    """Write a benchmark's ``result`` to ``path``: :func:`provenance`'s fields first, then
    the result's own. The document written is returned. A result may not set the
    provenance fields itself: every result describes its machine the same way."""
    described = provenance()
    clash = sorted(described.keys() & result.keys())
    if clash:
        raise ValueError(f"a result sets {clash} itself; write_result adds them")
    document = {**described, **result}
    write_json(path, document)
    return document
