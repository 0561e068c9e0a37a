"""One real vLLM engine (CPU build, tiny model, the kvtether plugin) and one daemon for
the whole session: starting vLLM costs ~20 s, so every end-to-end test shares it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.daemon import DaemonController
from tests.support.engine import engine_available, tiny_model_dir
from tests.support.redis_server import free_port

# 32 blocks x 128 tokens: small enough that a few agent jobs fill it.
NUM_BLOCKS = 32
BLOCK_TOKENS = 128


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            if not engine_available():
                item.add_marker(pytest.mark.skip(
                    reason="vLLM is not installed: scripts/dev.sh test installs it"))


@dataclass
class LiveEngine:
    base_url: str
    engine_id: str
    daemon: DaemonController
    log_path: Path


# The engine always reports with this token: a daemon without auth ignores it, one with
# auth tokens (tests/e2e/test_retention.py) lists its scope in auth.engine_scopes.
ENGINE_TOKEN = "e2e-engine-token-0123456789"


@pytest.fixture(scope="session")
def daemon() -> Iterator[DaemonController]:
    controller = DaemonController()
    controller.start("continuum")
    yield controller
    controller.stop()


@pytest.fixture(scope="session")
def engine(daemon: DaemonController, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LiveEngine]:
    from tests.support.launch import EngineSpec, start_engine, wait_healthy

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    spec = EngineSpec(model_dir=tiny_model_dir(), port=port, daemon_address=daemon.address,
                      num_blocks=NUM_BLOCKS, engine_id="e2e-engine",
                      # Generous on a loaded CI machine; the overhead benchmark
                      # measures the real lag.
                      deadline_ms=float(os.environ.get("KVTETHER_E2E_DEADLINE_MS", "500")),
                      env={"KVTETHER_PLUGIN_PROVISIONAL_PIN_S": "2",
                           "KVTETHER_PLUGIN_MAX_PIN_S": "10",
                           "KVTETHER_PLUGIN_TOKEN": ENGINE_TOKEN})
    process = start_engine(spec, log_path)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
    except Exception:
        process.kill()
        print(log_path.read_text()[-5000:])
        raise
    yield LiveEngine(f"http://127.0.0.1:{port}", spec.engine_id, daemon, log_path)
    process.terminate()
    with contextlib.suppress(Exception):
        process.wait(timeout=30)
    if process.poll() is None:
        process.kill()
