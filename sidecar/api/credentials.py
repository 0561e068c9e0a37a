"""Client TLS credentials for the daemon's gRPC servers: what the engine plugin,
``kvtether inspect`` and tools present. The server side is ``sidecar.server.transport``."""

from __future__ import annotations

from pathlib import Path

import grpc


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = ""
                        ) -> grpc.ChannelCredentials:
    """Trust ``ca_file`` (system roots when empty); present a client certificate for
    mutual TLS when ``cert_file`` and ``key_file`` are given."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file),
                                        private_key=_read(key_file),
                                        certificate_chain=_read(cert_file))


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None
