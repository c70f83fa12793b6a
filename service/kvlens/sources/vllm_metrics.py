"""vLLM's own ``/metrics``: the engine-reported counters kvlens re-exports to reconcile with.

vLLM's exposition cannot give a request hit ratio (it has only aggregates), but its token
counters let a dashboard put the engine's token reuse beside kvlens's. Names differ across
versions (``reference/engines.md`` section 1.2):

- ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (0.9.2+): tokens;
- ``vllm:gpu_prefix_cache_queries`` / ``..._hits``: **blocks** in 0.8.x, tokens in 0.9.x; the
  HELP text says which ("in terms of number of queried blocks"), and blocks are never mixed
  with tokens;
- ``vllm:prompt_tokens``, ``vllm:prompt_tokens_cached`` (0.16+), ``vllm:request_success``;
- ``vllm:num_requests_running`` (a gauge: the running batch).

:func:`fetch` enforces a hard total deadline and a size cap (httpx's timeouts are per phase, so a
server dripping one byte a second would otherwise hold a scrape for minutes).
"""

from __future__ import annotations

import asyncio
import math
import urllib.parse
from dataclasses import dataclass
from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvlens.errors import ScrapeError

# engine family (name without _total) -> (kvlens counter when counting tokens, when counting blocks)
COUNTERS: Final = {
    "vllm:prefix_cache_queries": ("prefix_cache_queried_tokens", None),
    "vllm:prefix_cache_hits": ("prefix_cache_hit_tokens", None),
    "vllm:gpu_prefix_cache_queries": ("prefix_cache_queried_tokens", "prefix_cache_queried_blocks"),
    "vllm:gpu_prefix_cache_hits": ("prefix_cache_hit_tokens", "prefix_cache_hit_blocks"),
    "vllm:prompt_tokens": ("prompt_tokens", None),
    "vllm:prompt_tokens_cached": ("cached_prompt_tokens", None),
    "vllm:request_success": ("requests", None),
}
RUNNING: Final = "vllm:num_requests_running"


@dataclass(frozen=True)
class EngineSample:
    counter: str  # a value of COUNTERS, e.g. "prefix_cache_hit_tokens"
    model: str
    series: tuple[tuple[str, str], ...]  # the sample's full label set, to track resets per series
    value: float


@dataclass(frozen=True)
class EngineScrape:
    counters: list[EngineSample]
    running: dict[str, float]  # model -> requests running now (summed over engines)


def target_name(url: str) -> str:
    """The ``target`` label of a scrape URL: host:port, plus the path when it is not /metrics."""
    parts = urllib.parse.urlsplit(url)
    path = "" if parts.path in ("", "/metrics") else parts.path
    return f"{parts.netloc}{path}"


async def fetch(client: httpx.AsyncClient, url: str, *, deadline_seconds: float, max_bytes: int) -> str:
    async def read() -> bytes:
        async with client.stream("GET", url, headers={"accept": "text/plain"}) as response:
            if response.status_code != 200:
                raise ScrapeError("http_status", f"{url} answered {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ScrapeError("too_large", f"{url} sent more than {max_bytes} bytes")
            return bytes(body)

    try:
        body = await asyncio.wait_for(read(), deadline_seconds)
    except asyncio.TimeoutError:
        raise ScrapeError("timeout", f"{url} did not finish within {deadline_seconds} s") from None
    except httpx.HTTPError as error:
        raise ScrapeError("connect", f"{url}: {type(error).__name__}") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("parse", f"{url} sent invalid UTF-8") from None


def parse(text: str) -> EngineScrape:
    """The engine counters and the running batch in a vLLM exposition; raises ScrapeError."""
    counters: list[EngineSample] = []
    running: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            name = family.name
            if name in COUNTERS and family.type == "counter":
                tokens, blocks = COUNTERS[name]
                # vLLM 0.8.x counted prefix-cache blocks under the same names; its HELP says so.
                counter = blocks if blocks and "block" in family.documentation.lower() else tokens
                for sample in family.samples:
                    if sample.name.endswith("_total"):  # values are checked where they are added
                        counters.append(
                            EngineSample(
                                counter,
                                sample.labels.get("model_name", ""),
                                tuple(sorted(sample.labels.items())),
                                float(sample.value),
                            )
                        )
            elif name == RUNNING:
                for sample in family.samples:
                    if math.isfinite(sample.value):
                        model = sample.labels.get("model_name", "")
                        running[model] = running.get(model, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError) as error:
        raise ScrapeError("parse", f"exposition does not parse: {type(error).__name__}") from None
    return EngineScrape(counters, running)
