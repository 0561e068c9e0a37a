"""The wire API: generated stubs for ``proto/kvtether/v1`` (see proto/README.md).

Import them through ``sidecar.api.v1``; regenerate with ``python -m sidecar.api.generate``.
"""
