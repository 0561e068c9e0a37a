"""The real daemon built in this process (real grpc.aio server on a free port)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sidecar.config import load_config
from sidecar.server.app import Daemon


@contextlib.asynccontextmanager
async def inprocess_daemon(**flags: Any) -> AsyncIterator[tuple[Daemon, grpc.aio.Channel]]:
    config = load_config(None, {"listen": {"tcp": "127.0.0.1:0"}, "metrics": {"port": -1},
                                "grace_s": 0.5, **flags})
    daemon = await Daemon.build(config)
    await daemon.start()
    channel = grpc.aio.insecure_channel(daemon.addresses[0])
    try:
        yield daemon, channel
    finally:
        await channel.close()
        await daemon.stop()
