"""What a benchmark ran on, for its JSON: figures from different machines do not compare."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def machine() -> dict[str, Any]:
    import psutil

    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def git_rev() -> str:
    """This checkout's commit, ``+dirty`` with uncommitted changes; "unknown" outside git."""
    try:
        def git(*argv: str) -> str:
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain")
                                                      else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
