"""The wire API passes ``buf lint`` (STANDARD and COMMENTS, with the exceptions
``buf.yaml`` records) and ``buf breaking`` against the committed baseline
(``proto/buf-baseline.txtpb``), and both checks fail on what they exist to catch.

``scripts/dev.sh buf`` runs the pinned buf, installing it under ``.cache/buf`` from
npm when it is missing (``scripts/dev.sh test`` installs it before the suite).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "proto" / "buf-baseline.txtpb"
RETENTION = Path("proto/kvtether/v1/retention.proto")


def _buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "dev.sh"), "buf", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def _workspace_copy(tmp_path: Path) -> Path:
    """buf.yaml and proto/ in a scratch directory, to be edited."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    return tmp_path


def test_the_protos_pass_buf_lint() -> None:
    done = _buf("lint", str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_protos_keep_compatibility_with_the_baseline() -> None:
    done = _buf("breaking", str(ROOT), "--against", str(BASELINE))
    assert done.returncode == 0, done.stdout + done.stderr


def test_lint_refuses_a_field_without_a_comment(tmp_path: Path) -> None:
    workspace = _workspace_copy(tmp_path)
    proto = workspace / RETENTION
    proto.write_text(proto.read_text().replace(
        "message AnnounceToolCallResponse {}",
        "message AnnounceToolCallResponse {\n  string note = 1;\n}"))
    done = _buf("lint", str(workspace))
    assert done.returncode != 0
    assert 'Field "note" should have a non-empty comment' in done.stdout, done.stdout


def test_breaking_refuses_a_renamed_field_and_allows_a_new_one(tmp_path: Path) -> None:
    workspace = _workspace_copy(tmp_path)
    proto = workspace / RETENTION
    original = proto.read_text()
    proto.write_text(original.replace(
        "message AnnounceToolCallResponse {}",
        "message AnnounceToolCallResponse {\n  // Added.\n  string note = 1;\n}"))
    added = _buf("breaking", str(workspace), "--against", str(BASELINE))
    assert added.returncode == 0, added.stdout + added.stderr

    proto.write_text(original.replace("string owner_scope = 2;", "string owner = 2;"))
    renamed = _buf("breaking", str(workspace), "--against", str(BASELINE))
    assert renamed.returncode != 0
    assert 'changed name from "owner_scope" to "owner"' in renamed.stdout, renamed.stdout
