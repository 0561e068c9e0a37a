"""A real Redis for the tests: ``REDIS_URL`` if set, else a testcontainers Redis when a
Docker engine answers, else a ``redis-server`` binary started on a free port.

``REDIS_URL`` must name a disposable database: the suite flushes it between tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

_PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before in this process. The kernel may
    give a just-closed port again, and a test that asks for two (a daemon's main and
    inspect ports) would get one port for both."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.add(port)
            return port


def wait_for_redis(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis.from_url(url, socket_timeout=0.5).ping()
            return
        except redis.AuthenticationError:
            return  # up, and asking for a password
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def redis_binary(port: int | None = None, extra_args: tuple[str, ...] = ()) -> Iterator[
    tuple[str, subprocess.Popen[bytes]]
]:
    """Start ``redis-server`` on a free port (nothing saved to disk); yield (url, process)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "no redis-server binary: install Debian's redis-server (the README's test "
            "command does) or set REDIS_URL"
        )
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="kvtether-redis-")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--dir", workdir, *extra_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_redis(url)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def provide_redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    if _docker_answers():
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7-alpine") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
        return
    with redis_binary() as (url, _process):
        yield url


class RedisProcess:
    """A redis-server that persists every write (AOF, fsync always) and can be killed
    and restarted on the same port and data directory."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="kvtether-redis-aof-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is installed by scripts/dev.sh test"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_redis(self.url)

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
            self.process = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
