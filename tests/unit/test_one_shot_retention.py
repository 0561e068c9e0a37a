"""One-shot traffic next to an agent on vLLM's real block pool (docs/decisions/022):
whatever the policy, a flood of requests with no job does not outrank a client's
directive on the agent's prompt."""

from __future__ import annotations

import pytest

from sidecar.framework.types import RetainAction
from sidecar.policies.registry import available_policies, build_policy
from tests.support.engine import requires_vllm
from tests.unit.builders import step
from tests.unit.test_retention_pool import (
    BLOCK,
    free,
    retain,
    retention_pool,
    sequence,
    still_cached,
)

pytestmark = requires_vllm

LS_S = [0.9, 1.0, 1.1]  # three tool gaps of about a second: the cold start


@pytest.mark.parametrize("name", list(available_policies()))
def test_a_directive_on_an_agents_prompt_outlives_one_shot_traffic(name: str) -> None:
    policy = build_policy(name, {})
    pool = retention_pool(16)
    agent = sequence(pool, 3)
    retain(agent, 70, scope="client")  # the client's directive: keep the prompt at 70
    free(agent)
    # Eight one-shot requests, each answering with a tool call; each finish applied as
    # the engine applies the policy's word: a retention priority is the policy's own
    # (anonymous scope), lasting ttl_s.
    for index in range(8):
        once = sequence(pool, 4)
        s = step(now=20.0, total_blocks=16, free_blocks=pool.get_num_free_blocks(),
                 block_size=BLOCK).times("ls", LS_S).running(f"once-{index}", job=None,
                                                             arrive=19.5, prompt=4 * BLOCK)
        decision = policy.on_finish(s.finish(f"once-{index}", tool="ls", samples_s=LS_S,
                                             global_samples_s=LS_S, blocks=4))
        assert decision.action is not RetainAction.PIN
        if decision.retention_priority is not None:
            retain(once, decision.retention_priority, decision.ttl_s or None, scope="")
        free(once)
    # Memory runs short: a request takes every free block but three.
    sequence(pool, pool.get_num_free_blocks() - 3)
    assert still_cached(agent) == 3, "the one-shot contexts give way first"
