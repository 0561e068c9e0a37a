"""The committed stubs are exactly what the pinned generator makes of proto/."""

from __future__ import annotations

import subprocess
import sys


def test_generated_stubs_are_up_to_date() -> None:
    done = subprocess.run([sys.executable, "-m", "sidecar.api.generate", "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
