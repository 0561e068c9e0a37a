"""Effective retention of one request: its own directives (vllm_xargs) resolved against
those pushed for its job or session, ownership applied.

- A request's own directives are validated here; invalid ones are ignored with a
  warning (the request still runs, as if it had sent none).
- Directives pushed by other scopes combine with the request's token by token, the
  strongest winning: a request can raise them, never lower them.
- A request whose (trusted) scope owns a pushed directive speaks for that owner: its
  own directives replace the pushed ones for this request (the owner may lower).
- With authentication on, a request's ``retention_scope`` is only a claim (anyone
  who can reach vLLM's API can write it): it counts as anonymous.

The result carries the scope that owns it, for the engine's per-block ownership.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from sidecar.api.retention_ownership import ANONYMOUS
from sidecar.api.retention_ranges import DirectiveError, merge, validate
from sidecar.api.v1 import retention_pb2 as pb
from sidecar.retention.directives import StoredDirective
from sidecar.retention.directory import RetentionDirectory

log = structlog.get_logger("kvtether.retention")


@dataclass(frozen=True, slots=True)
class EffectiveRetention:
    config: pb.RetentionConfig
    # The scope that owns these priorities ("" = anonymous: it may only raise).
    scope: str
    # What set them: the request's own directives, how many of those pushed for its
    # job or session, and how many pushed ones its own replaced (as their owner).
    from_request: bool = False
    pushed: int = 0
    pushed_replaced: int = 0

    def source(self) -> str:
        """What set these priorities, in words (a decision's reason)."""
        if self.from_request and self.pushed:
            return (f"the request's own directives combined with {self.pushed} pushed for "
                    "its job or session (per token, the highest priority wins)")
        if self.from_request and self.pushed_replaced:
            return (f"the request's own directives, replacing the {self.pushed_replaced} "
                    f"its scope {self.scope!r} pushed for its job or session")
        if self.from_request:
            return "the request's own directives (none pushed for its job or session)"
        return (f"{self.pushed} directive(s) pushed for its job or session "
                "(the request carried none)")

    def key(self) -> bytes:
        """Equal for equal retentions (to send only changes)."""
        return self.scope.encode() + b"\0" + self.config.SerializeToString(deterministic=True)


def resolve(
    request_config: pb.RetentionConfig | None,
    request_scope: str,
    pushed: Sequence[StoredDirective],
) -> EffectiveRetention | None:
    """Combine a request's (valid) directives with the ones pushed for its job."""
    speaks_for_owner = request_config is not None and request_scope != ANONYMOUS
    kept = [d for d in pushed if not (speaks_for_owner and d.owner_scope == request_scope)]
    configs = [d.config for d in kept]
    if request_config is not None:
        configs.append(request_config)
    if not configs:
        return None
    owners = [d.owner_scope for d in pushed]
    return EffectiveRetention(merge(configs), owners[0] if owners else request_scope,
                              from_request=request_config is not None, pushed=len(kept),
                              pushed_replaced=len(pushed) - len(kept))


class RetentionResolver:
    """What the decider asks, per request: its effective retention, if any."""

    def __init__(self, directory: RetentionDirectory, trust_request_scopes: bool) -> None:
        self.directory = directory
        self._trust_request_scopes = trust_request_scopes

    @property
    def generation(self) -> int:
        return self.directory.generation

    def for_request(
        self,
        request_id: str,
        job_id: str,
        request_config: pb.RetentionConfig | None,
        request_scope: str,
    ) -> EffectiveRetention | None:
        if request_config is not None:
            try:
                validate(request_config)
            except DirectiveError as error:
                log.warning("retention_directives_ignored", request_id=request_id,
                            error=str(error))
                request_config = None
        scope = request_scope if self._trust_request_scopes else ANONYMOUS
        return resolve(request_config, scope, self.directory.for_job(job_id))
