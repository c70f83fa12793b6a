"""Who may reach a server: whether a listen address is this machine's alone, and the bearer
check. Apart from :mod:`.server` so that settings can ask without importing uvicorn (every
command reads settings; only the servers start uvicorn)."""

from __future__ import annotations

import hmac
import ipaddress


def loopback(host: str) -> bool:
    """Whether a listen address reaches only this machine (a host name may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_matches(authorization: str, token: bytes) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>``, compared in constant time."""
    scheme, _, presented = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        presented.strip().encode("utf-8", "replace"), token
    )
