"""Retention: orchestrator-directed KV eviction priorities (TensorRT-LLM's
KvCacheRetentionConfig semantics) with authenticated ownership.

- ``ranges``: what a config means (validation, per-token and per-block priorities,
  raises vs. lowerings over time, merging, the vllm_xargs shape); pure.
- ``ownership``: who may change a directive; one rule for the store and the engine.
- ``directives``: the store encoding and the atomic Set/Clear transitions.
- ``auth``: bearer tokens to scopes.
- ``directory`` / ``resolve``: the daemon's view of pushed directives, and a request's
  effective retention (its own directives resolved against them).

The engine side is ``vllm_plugin.retention`` (priorities on vLLM's own block pool).
"""
