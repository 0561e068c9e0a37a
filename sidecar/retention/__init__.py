"""Retention: orchestrator-directed KV eviction priorities (TensorRT-LLM's
KvCacheRetentionConfig semantics) with authenticated ownership.

- what a config means and who may change it: ``sidecar.api.retention_ranges`` and
  ``sidecar.api.retention_ownership``, shared with the engine plugin;
- ``directives``: the store encoding and the atomic Set/Clear transitions.
- ``auth``: bearer tokens to scopes.
- ``directory`` / ``resolve``: the daemon's view of pushed directives, and a request's
  effective retention (its own directives resolved against them).

The engine side is ``vllm_plugin.retention`` (priorities on vLLM's own block pool).
"""
