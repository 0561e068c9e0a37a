"""The committed stubs are exactly what the pinned generator makes of proto/.

The generator (the ``stubgen`` extra) needs protobuf < 6, which vLLM's environment
cannot have, so it runs in an environment of its own: the one ``scripts/dev.sh`` keeps
under ``.cache/stubgen``, made here when it is missing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBGEN = ROOT / ".cache" / "stubgen"


def _stubgen_python() -> Path:
    python = STUBGEN / "bin" / "python"
    requirement = subprocess.run(
        [sys.executable, "-m", "sidecar.api.generate", "--print-requirement"],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    stamp = STUBGEN / ".requirement"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == requirement:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(STUBGEN)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    requirement], check=True, timeout=300)
    stamp.write_text(requirement + "\n")
    return python


def test_generated_stubs_are_up_to_date() -> None:
    done = subprocess.run([str(_stubgen_python()), "-m", "sidecar.api.generate", "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_the_check_names_a_missing_generator() -> None:
    # This environment (vLLM's) has no grpcio-tools: the check says what to do.
    done = subprocess.run([sys.executable, "-m", "sidecar.api.generate", "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1
    assert "scripts/dev.sh stubs" in done.stderr and "grpcio-tools==" in done.stderr
