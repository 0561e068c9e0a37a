"""A sweep's points, read the same way whether a sweep just wrote them or git keeps them.

A sweep writes one JSON file a point, ``points/<label>/blocks<N>/<policy>-<jps>jps.json``
(with ``meta.json``, ``timings.json`` and ``summary.json`` beside them), so an
interrupted sweep resumes where it stopped. The tree keeps each sweep as one lossless
pack instead, ``points/<label>.json.xz`` (hundreds of small files become one), written by
``python -m benchmarks.twin pack LABEL``. Readers prefer the folder, the fresher of the
two, and fall back to the pack.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any


def pack_path(points_dir: Path, label: str) -> Path:
    return points_dir / f"{label}.json.xz"


def _read_pack(points_dir: Path, label: str) -> dict[str, Any] | None:
    path = pack_path(points_dir, label)
    if not path.exists():
        return None
    pack: dict[str, Any] = json.loads(lzma.decompress(path.read_bytes()))
    return pack


def read_points(points_dir: Path, label: str) -> dict[str, dict[str, Any]]:
    """Each point of a sweep by its key, ``"blocks<N>/<policy>-<jps>jps"``."""
    folder = points_dir / label
    if folder.is_dir():
        return {path.relative_to(folder).with_suffix("").as_posix(): json.loads(path.read_text())
                for path in sorted(folder.glob("blocks*/*.json"))}
    pack = _read_pack(points_dir, label)
    return dict(pack["points"]) if pack is not None else {}


def read_meta(points_dir: Path, label: str) -> dict[str, Any]:
    """What the sweep ran with (``meta.json``): workload, efficiency, every command."""
    meta_path = points_dir / label / "meta.json"
    if meta_path.exists():
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        return meta
    pack = _read_pack(points_dir, label)
    return dict(pack["meta"]) if pack is not None else {}


def labels(points_dir: Path, pattern: str) -> list[str]:
    """The sweep labels matching a glob pattern, as folders or as packs."""
    found = {path.name for path in points_dir.glob(pattern) if path.is_dir()}
    found |= {path.name.removesuffix(".json.xz")
              for path in points_dir.glob(f"{pattern}.json.xz")}
    return sorted(found)


def write_pack(points_dir: Path, label: str) -> Path:
    """Packs a sweep's folder into ``points/<label>.json.xz``; the folder is left as is."""
    folder = points_dir / label
    if not folder.is_dir():
        raise FileNotFoundError(f"no sweep folder {folder} to pack")

    def optional(name: str) -> Any:
        path = folder / name
        return json.loads(path.read_text()) if path.exists() else None

    pack = {"label": label, "meta": optional("meta.json") or {},
            "summary": optional("summary.json"), "timings_s": optional("timings.json") or {},
            "points": read_points(points_dir, label)}
    target = pack_path(points_dir, label)
    staged = target.with_name(target.name + ".tmp")
    staged.write_bytes(lzma.compress(json.dumps(pack, separators=(",", ":")).encode(),
                                     preset=9 | lzma.PRESET_EXTREME))
    staged.replace(target)
    return target
