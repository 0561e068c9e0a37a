"""What the engine-side tests need: the tiny model directory and vLLM's availability."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

import pytest

from tests.support.launch import engine_python, tiny_model_dir

__all__ = ["engine_available", "requires_vllm", "tiny_model_dir", "vllm_available"]


def vllm_available() -> bool:
    """vLLM in this interpreter (the in-process scheduler tests need it)."""
    return importlib.util.find_spec("vllm") is not None


@functools.cache
def engine_available() -> bool:
    """vLLM in the interpreter that runs the engine (``KVTETHER_ENGINE_PYTHON``)."""
    python = engine_python()
    if python == sys.executable:
        return vllm_available()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], check=False, timeout=60).returncode == 0


requires_vllm = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed: scripts/dev.sh test installs it (scripts/install_engine.sh)",
)
