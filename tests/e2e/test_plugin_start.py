"""Starting a real vLLM with the plugin's settings wrong: a misspelt ``KVTETHER_PLUGIN_*``
variable stops it at once with one line naming the variable; with the plugin switched
off, garbage in the other variables does not stop it, and it serves.

Each test starts its own engine (not the session's shared one: these settings are
what is under test). The first stops while vLLM parses its arguments, in seconds.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
from pathlib import Path

from tests.support.launch import EngineSpec, start_engine, tiny_model_dir, wait_healthy
from tests.support.redis_server import free_port


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    if process.poll() is None:
        process.kill()


def test_a_misspelt_variable_stops_vllm_with_one_line_naming_it(tmp_path: Path) -> None:
    log_path = tmp_path / "vllm.log"
    spec = EngineSpec(model_dir=tiny_model_dir(), port=free_port(),
                      daemon_address="127.0.0.1:1",
                      env={"KVTETHER_PLUGIN_DAEMON_ADRESS": "unix:/run/kvtether.sock"})
    process = start_engine(spec, log_path)
    try:
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            stop(process)
    log = log_path.read_text()
    assert code != 0, log
    named = [line for line in log.splitlines() if "KVTETHER_PLUGIN_DAEMON_ADRESS" in line]
    assert named == ["kvtether: KVTETHER_PLUGIN_DAEMON_ADRESS: unknown variable; "
                     "did you mean KVTETHER_PLUGIN_DAEMON_ADDRESS?"], log
    assert "Traceback" not in log, log


def test_disabled_with_garbage_in_the_other_variables_vllm_starts_and_serves(
        tmp_path: Path) -> None:
    log_path = tmp_path / "vllm.log"
    port = free_port()
    spec = EngineSpec(model_dir=tiny_model_dir(), port=port, daemon_address="",
                      num_blocks=17,
                      env={"KVTETHER_PLUGIN_ENABLED": "0",
                           "KVTETHER_PLUGIN_DAEMON_ADRESS": "unix:/run/kvtether.sock",
                           "KVTETHER_PLUGIN_DEADLINE_MS": "fast",
                           "KVTETHER_PLUGIN_FAIL_MODE": "sideways",
                           "KVTETHER_PLUGIN_TOKEN_FILE": "/no/such/file"})
    process = start_engine(spec, log_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base_url, process)
        except Exception:
            print(log_path.read_text()[-5000:])
            raise
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            status, completion = answer.status, json.loads(answer.read())
    finally:
        stop(process)
    assert status == 200
    assert completion["usage"]["completion_tokens"] >= 1
    assert "unknown variable" not in log_path.read_text()
