"""What a separate virtual environment made by a test has installed."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path

from packaging.utils import canonicalize_name


def installed_versions(python: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each distribution ``python``'s environment has, by its canonical name (PEP 503:
    ``prometheus_client`` and ``Prometheus-Client`` are both ``prometheus-client``)."""
    listing = subprocess.run([str(python), "-m", "pip", "list", "--format", "json",
                              "--disable-pip-version-check"],
                             capture_output=True, text=True, check=True,
                             env=None if env is None else dict(env))
    return {canonicalize_name(item["name"]): item["version"]
            for item in json.loads(listing.stdout)}
