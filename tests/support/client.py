"""Client side of the plugin's contract: how an agent tells vLLM which job a request
belongs to, through the OpenAI API (``extra_body={"vllm_xargs": {...}}``).

Used by the demo, the end-to-end tests and the real-engine benchmark; what a user's
agent framework sends is :func:`job_xargs`'s ``extra_body`` (the README shows it).
"""

from __future__ import annotations

from typing import Any


def job_xargs(job_id: str, is_last_step: bool, tool: str | None = None) -> dict[str, Any]:
    """The ``extra_body`` for one turn of an agent job. Booleans travel as 0/1 (vLLM's
    ``vllm_xargs`` accepts str, int, float and lists only)."""
    xargs: dict[str, Any] = {"job_id": job_id, "is_last_step": int(is_last_step)}
    if tool:
        xargs["tool"] = tool
    return {"vllm_xargs": xargs}


class AgentJob:
    """A multi-turn agent over the OpenAI chat API: each turn's prompt is the whole
    conversation so far plus the previous turn's tool output, so consecutive turns
    share a growing prefix (what pins keep warm)."""

    def __init__(self, api: Any, job_id: str, seed: int, model: str = "tiny") -> None:
        self.api = api
        self.job_id = job_id
        self.seed = seed
        self.model = model
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"agent {seed}: " + "You fix bugs in a repo. " * 30},
            {"role": "user", "content": f"task {seed}: make the failing test pass. " * 12},
        ]

    def turn(self, last: bool, tool: str = "ls", max_tokens: int = 16,
             priority: int = 0) -> Any:
        """Send the next turn (at the client ``priority``, vLLM's request field: lower
        is served first); return the OpenAI response (usage has cached tokens)."""
        answer = self.api.chat.completions.create(
            model=self.model,
            messages=self.messages,
            max_tokens=max_tokens,
            extra_body={**job_xargs(self.job_id, last, tool), "ignore_eos": True,
                        "priority": priority},
        )
        self.messages.append(
            {"role": "assistant", "content": answer.choices[0].message.content or ""})
        self.messages.append({"role": "user", "content": f"$ {tool}\n"
                              + f"src/module_{self.seed}.py tests/test_{self.seed}.py " * 8})
        return answer


def cached_tokens(answer: Any) -> int:
    """Prompt tokens served from the prefix cache (needs vLLM's
    ``--enable-prompt-tokens-details``)."""
    details = getattr(answer.usage, "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", 0) or 0)
