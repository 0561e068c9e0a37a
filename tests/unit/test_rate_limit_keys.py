"""Whom a rate limit counts a call against: the caller's address, never its port."""

from __future__ import annotations

import pytest

from sidecar.server.limits import peer_address


@pytest.mark.parametrize(
    ("peer", "address"),
    [("ipv4:10.0.0.7:5678", "ipv4:10.0.0.7"),
     ("ipv4:10.0.0.7:40001", "ipv4:10.0.0.7"),
     ("ipv6:[::1]:5678", "ipv6:[::1]"),
     ("ipv6:%5B2001:db8::1%5D:443", "ipv6:%5B2001:db8::1%5D"),
     ("unix:/run/kvtether.sock", "unix"),
     ("unix:", "unix"),
     ("unix-abstract:kvtether", "unix"),
     ("ipv4:10.0.0.7", "ipv4:10.0.0.7")],
)
def test_a_caller_is_its_address_without_the_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address
