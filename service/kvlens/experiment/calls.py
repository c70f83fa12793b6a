"""The runner's calls to an endpoint besides the replayed streams: the model list and the
engine's block size (checks), the cache resets, the quantization experiment's samples of the
engine's ``/metrics``, and ``/detokenize`` (``--api chat``).

Each goes through the one bounded client kvlens has for outside servers
(:func:`kvlens.sources.bounded_http.exchange`, the sidecar's scrape uses it too): a deadline over
the whole call, connecting and head included (a server that trickles a byte now and then is given
up at it, never waited for), and at most MAX_CALL_BYTES of answer once inflated (a gzip bomb
stops there). A failed call raises :class:`~kvlens.errors.ScrapeError`; its message names the
endpoint without userinfo (``Endpoint.url`` has none).
"""

from __future__ import annotations

import asyncio
import math
from typing import Final

import httpx

from kvlens.sources.bounded_http import Answer, exchange
from kvlens.sources.encoding import DecodeLimits

CHECK_SECONDS: Final = 10.0  # /v1/models, and /metrics for the block size: each call in all
RESET_SECONDS: Final = 30.0  # emptying the cache: every reset path tried, together
SAMPLE_SECONDS: Final = 5.0  # one sample of /metrics during a step (the sidecar's scrape timeout)
# One answer at most, once inflated: a vLLM /metrics is well under a MiB, a /detokenize of a
# 128k-token prompt a few; the sidecar's scrape_max_bytes.
MAX_CALL_BYTES: Final = 16 * 1024 * 1024
# No ratio limit (the byte cap bounds memory; an exposition compresses very well); 16 gzip
# members as the sidecar's max_gzip_members.
LIMITS: Final = DecodeLimits(MAX_CALL_BYTES, math.inf, 16)


def client() -> httpx.AsyncClient:
    """The connection pool of a run's calls (no redirects: an endpoint is where it says). httpx's
    own timeouts are off: each call's deadline is its one bound (httpx's default 5 s per read
    would end a reset that answers in 6 s of its 30)."""
    return httpx.AsyncClient(follow_redirects=False, timeout=None)


async def call(
    pool: httpx.AsyncClient,
    url: str,
    method: str,
    path: str,
    *,
    headers: dict[str, str],
    seconds: float,
    content: bytes | None = None,
) -> Answer:
    """``method url+path`` within ``seconds`` in all and LIMITS; ``url`` holds no userinfo (its
    credentials are in ``headers``)."""
    return await exchange(
        pool,
        method,
        f"{url}{path}",
        name=f"{url}{path}",
        deadline_seconds=seconds,
        limits=LIMITS,
        headers=headers,
        content=content,
    )


def call_now(url: str, method: str, path: str, *, headers: dict[str, str], seconds: float) -> Answer:
    """:func:`call` from outside an event loop (the checks and resets run between replays)."""

    async def run() -> Answer:
        async with client() as pool:
            return await call(pool, url, method, path, headers=headers, seconds=seconds)

    return asyncio.run(run())
