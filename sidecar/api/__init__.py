"""What the engine plugin and the daemon share: the wire and the rules both sides apply.

- ``v1`` (and ``kvtether/v1``): the generated stubs for ``proto/kvtether/v1``
  (see proto/README.md); regenerate with ``python -m sidecar.api.generate``.
- ``bounds``, ``messages``: the limits on every field a caller sends.
- ``retention_ranges``, ``retention_ownership``: what a retention config means and
  who may change it; ``retention_dialects``: TensorRT-LLM's config converted to it.
- ``kv_hints``: what kvtether reads from vLLM's KV hint envelope.
- ``toolcalls``: which tool a finished turn called.
- ``credentials``: client TLS credentials for the daemon's servers.

The plugin imports this package inside vLLM's engine process, so it imports only the
standard library, grpcio and protobuf (``tests/unit/test_layering.py`` checks it).
"""
