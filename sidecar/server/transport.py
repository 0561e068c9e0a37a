"""How the daemon's gRPC servers listen: TCP (plain or TLS / mutual TLS) and a Unix socket.
The client side is ``sidecar.api.credentials``."""

from __future__ import annotations

from pathlib import Path

import grpc

from sidecar.config import TlsConfig


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the TCP listeners, or None for plaintext. With a client CA,
    clients must present a certificate it signed (mutual TLS)."""
    if not tls.enabled:
        return None
    key = Path(tls.key_file).read_bytes()
    cert = Path(tls.cert_file).read_bytes()
    client_ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None)


def bind_tcp(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None,
             setting: str) -> str:
    """Bind a TCP address; return it with the real port when port 0 was asked for.
    OSError naming ``setting`` when it cannot be bound (in use, or not this host's)."""
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio's "Failed to bind to address ..."
        bound = 0
    if bound == 0:
        raise OSError(f"{setting}: cannot bind {address} (is another process listening "
                      "there, or is the address not this host's?)")
    host, _, port = address.rpartition(":")
    return f"{host}:{bound}" if port == "0" else address
