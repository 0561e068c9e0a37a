"""``kvtether`` on an install without the daemon's extra (``pip install .`` in a
checkout, as in a vLLM image): the daemon's commands say in one line what to install;
``inspect``, a client, still works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import sidecar
from sidecar.cli import DAEMON_MODULES, parse_serve_config

ROOT = Path(__file__).resolve().parents[2]


def _kvtether_without_extra(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvtether ARGV`` in a fresh interpreter where the daemon extra's modules cannot
    be imported (``sys.modules[name] = None`` is how Python marks a module absent)."""
    probe = (
        "import sys\n"
        f"for name in {DAEMON_MODULES!r}:\n"
        "    sys.modules[name] = None\n"
        "from sidecar.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.mark.parametrize("argv", [("serve",), ("serve", "--policy", "continuum",
                                               "--param", "fixed_ttl_s=2"), ("policies",)])
def test_daemon_commands_name_the_extra_in_one_line(argv: tuple[str, ...]) -> None:
    done = _kvtether_without_extra(*argv)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    # What installs the extra where no package index has kvtether: a checkout or a wheel.
    assert "pip install '.[daemon]'" in lines[0]
    assert f"pip install 'kvtether-{sidecar.__version__}-py3-none-any.whl[daemon]'" in lines[0]
    assert f"kvtether {argv[0]}" in lines[0]
    assert "redis" in lines[0] and "pydantic" in lines[0]


def test_inspect_needs_no_extra() -> None:
    # Nothing listens on port 1: the client's own error, not an install hint.
    done = _kvtether_without_extra("inspect", "--address", "127.0.0.1:1",
                                   "--timeout-s", "0.5", "policy")
    assert done.returncode == 3, done.stderr
    assert "UNAVAILABLE" in done.stderr
    assert "Traceback" not in done.stderr and "[daemon]" not in done.stderr


def test_version_needs_no_extra() -> None:
    done = _kvtether_without_extra("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvtether {sidecar.__version__}\n"
    assert sidecar.__version__ != "0+unknown"  # read from the installed metadata


def test_param_values_are_yaml_scalars() -> None:
    config = parse_serve_config(["--policy", "continuum", "--param", "fixed_ttl_s=2.5",
                                 "--param", "pin_unmeasured_tools=false",
                                 "--param", "ttl_mode=fixed"])
    assert config.policy.params == {"fixed_ttl_s": 2.5, "pin_unmeasured_tools": False,
                                    "ttl_mode": "fixed"}


def test_a_reader_that_goes_away_ends_the_listing_quietly() -> None:
    # `kvtether policies | head -0`: the reader leaves before the first line is written.
    with subprocess.Popen([sys.executable, "-m", "sidecar.cli", "policies"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as listing:
        assert listing.stdout is not None and listing.stderr is not None
        listing.stdout.close()
        errors = listing.stderr.read().decode()
        code = listing.wait(timeout=60)
    assert "Traceback" not in errors and "BrokenPipe" not in errors, errors
    assert code == 141
