"""The Redis URLs kvtether accepts, parsed without importing redis (configuration
validation uses this at start-up).

    redis://[user:password@]host:port[/db]      one Redis server
    rediss://…                                  the same over TLS
    unix:///path/to/redis.sock[?db=N]           a local socket
    redis+cluster://[user:password@]host:port   Redis Cluster: any node as a seed, the
                                                others are discovered (db 0 only)
    rediss+cluster://…                          Redis Cluster over TLS

Two query parameters are kvtether's own and are removed before the URL reaches
redis-py (every other one is redis-py's, e.g. ``ssl_ca_certs``):

    replica_acks=N             a store transition (a retention directive's Set or Clear)
                               is acknowledged only after N replicas confirmed it (Redis
                               ``WAIT N timeout``) or the timeout passed; default 0 (do not
                               wait: Redis replication is asynchronous)
    replica_ack_timeout_ms=T   that timeout, default 100
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

CLUSTER_SUFFIX = "+cluster"
SERVER_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_REPLICA_ACK_TIMEOUT_MS = 100


@dataclass(frozen=True, slots=True)
class RedisTarget:
    # The URL for redis-py: ``+cluster`` and kvtether's parameters removed.
    client_url: str
    cluster: bool
    replica_acks: int = 0
    replica_ack_timeout_ms: int = DEFAULT_REPLICA_ACK_TIMEOUT_MS


def parse_redis_url(url: str) -> RedisTarget:
    """Split a store URL into what redis-py needs and kvtether's options.

    Raises ValueError with one line naming the problem (the password redacted)."""
    shown = redact(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SERVER_SCHEMES + CLUSTER_SCHEMES:
        raise ValueError(
            "expected a redis://, rediss://, unix://, redis+cluster:// or rediss+cluster:// "
            f"URL, got {shown!r}")
    cluster = scheme in CLUSTER_SCHEMES
    if scheme != "unix":
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"bad port in {shown!r}") from None
        if not parts.hostname:
            raise ValueError(f"no host in {shown!r}")
        if cluster and port is None:
            raise ValueError(f"a Redis Cluster URL names a node's host:port, got {shown!r}")
    if cluster and parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"Redis Cluster has database 0 only, got {shown!r}")

    options: dict[str, int] = {
        "replica_acks": 0, "replica_ack_timeout_ms": DEFAULT_REPLICA_ACK_TIMEOUT_MS}
    passed_on = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in options:
            if not value.isdigit():
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            options[name] = int(value)
        else:
            passed_on.append((name, value))
    if options["replica_ack_timeout_ms"] < 1:
        raise ValueError("replica_ack_timeout_ms must be at least 1")

    client_scheme = scheme.removesuffix(CLUSTER_SUFFIX)
    client_url = urlunsplit((client_scheme, parts.netloc, parts.path, urlencode(passed_on),
                             parts.fragment))
    return RedisTarget(client_url, cluster, options["replica_acks"],
                       options["replica_ack_timeout_ms"])


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"
