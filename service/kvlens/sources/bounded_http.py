"""One HTTP exchange with an outside server, bounded as a whole: every call kvlens makes to such
a server, other than the replay's streams, goes through :func:`exchange` (the sidecar's scrape of
an engine's ``/metrics``; the experiment runner's model list, block size, cache resets, engine
samples and ``/detokenize``).

httpx bounds each phase and each read, not the call: a server that sends a byte of its head or
of its body every few seconds holds a call for good, and httpx inflates a compressed answer whole
(a 1 MB gzip answer costs the GiB it inflates to). Here:

- one deadline over the whole exchange: connecting, the head, the body (``anyio.fail_after``,
  not ``asyncio.wait_for``, which before Python 3.12 returns the result when a cancellation lands
  as the call completes: a stopping loop then never ends);
- the body inflated as it arrives by :class:`~kvlens.sources.encoding.Inflater` (gzip is asked
  for; gzip, deflate or identity taken), refused as soon as its inflated bytes cross ``limits``;
- an answer other than 200 is not read (its body may never end).

Failures are :class:`~kvlens.errors.ScrapeError` with a closed reason: ``timeout``,
``too_large``, ``connect`` (any transport failure), ``parse`` (an encoding that cannot be
undone). Messages name the call by ``name`` only, never by its URL (which may hold a secret).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import anyio
import httpx

from kvlens.errors import CompressionBomb, InputError, PayloadTooLarge, ScrapeError
from kvlens.sources.encoding import DecodeLimits, Inflater


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytearray  # the inflated body of a 200; empty otherwise (not read)


async def exchange(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    name: str,
    deadline_seconds: float,
    limits: DecodeLimits,
    headers: dict[str, str] | None = None,
    auth: httpx.Auth | None = None,
    content: bytes | None = None,
) -> Answer:
    """``method url`` and its answer, within ``deadline_seconds`` in all and ``limits``."""

    async def read() -> Answer:
        sent = {"accept-encoding": "gzip", **(headers or {})}
        async with client.stream(method, url, headers=sent, auth=auth, content=content) as response:
            if response.status_code != 200:
                return Answer(response.status_code, bytearray())
            body = bytearray()
            try:
                inflater = Inflater(response.headers.get("content-encoding"), limits)
                # raw bytes: httpx would inflate each piece whole, with no bound
                async for chunk in response.aiter_raw():
                    body += await asyncio.to_thread(inflater.feed, chunk)
                body += inflater.finish()
            except (PayloadTooLarge, CompressionBomb):
                body.clear()  # this frame outlives the error in a reference cycle (Inflater._inflate)
                raise ScrapeError("too_large", f"{name} sent more than {limits.max_bytes} bytes") from None
            except InputError as error:
                body.clear()
                raise ScrapeError("parse", f"{name}: {error}") from None
            return Answer(200, body)  # as it is: a copy would cost up to limits.max_bytes more

    try:
        with anyio.fail_after(deadline_seconds):
            return await read()
    except TimeoutError:
        raise ScrapeError("timeout", f"{name} did not finish within {deadline_seconds:g} s") from None
    except httpx.HTTPError as error:
        raise ScrapeError("connect", f"{name}: {type(error).__name__}") from None
