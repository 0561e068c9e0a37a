"""What the engine-side tests need: the tiny model directory and vLLM's availability."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


requires_vllm = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed: scripts/dev.sh test installs it (scripts/install_engine.sh)",
)


def tiny_model_dir() -> Path:
    """The tiny Llama model (config + locally trained tokenizer), made once and reused."""
    target = Path(os.environ.get("KVTETHER_TINY_MODEL_DIR", ROOT / ".cache" / "tiny-llama"))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(target)],
                   check=True, capture_output=True, text=True, timeout=300)
    return target
