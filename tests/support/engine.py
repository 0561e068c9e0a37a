"""What the engine-side tests need: the tiny model directory and vLLM's availability."""

from __future__ import annotations

import importlib.util

import pytest

from vllm_plugin.launch import tiny_model_dir

__all__ = ["requires_vllm", "tiny_model_dir", "vllm_available"]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


requires_vllm = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed: scripts/dev.sh test installs it (scripts/install_engine.sh)",
)
