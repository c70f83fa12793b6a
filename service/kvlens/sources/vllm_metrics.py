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

:func:`fetch` goes through :func:`~kvlens.sources.bounded_http.exchange`: a hard total deadline
(httpx's timeouts are per phase, so a server dripping one byte a second would otherwise hold a
scrape for minutes) and a size cap on the inflated bytes, checked as they are produced (a few KiB
of gzip can inflate to GiBs).
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvlens.errors import ScrapeError
from kvlens.sources.bounded_http import exchange
from kvlens.sources.encoding import DecodeLimits

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
# prometheus_client's parser holds about 8 times a line while it reads its labels (a 15 MiB label
# line under scrape_max_bytes cost 136 MiB and 16 s); a real engine's lines are under 1 KiB.
MAX_LINE_CHARS: Final = 64 * 1024


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
    """The ``target`` label of a scrape URL: host:port, plus the path when it is not /metrics.

    Never the userinfo or the query: either may hold a secret, and the label is in every series
    and every log line about the target."""
    parts = urllib.parse.urlsplit(url)
    path = "" if parts.path in ("", "/metrics") else parts.path
    return f"{parts.netloc.rpartition('@')[2]}{path}"


@dataclass(frozen=True)
class ScrapeTarget:
    """A scrape URL taken apart: its name, the URL fetched (without userinfo) and its credentials
    (from the URL, or a username and a password file re-read at each scrape, as Prometheus'
    ``basic_auth.password_file`` is, so a rotated secret is picked up)."""

    name: str
    url: str = field(repr=False)  # its query may hold a secret
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: Path | None = None

    @classmethod
    def from_url(
        cls, url: str, username: str | None = None, password_file: Path | None = None
    ) -> ScrapeTarget:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        if parts.username is not None:
            username = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password) if parts.password is not None else None
        return cls(
            name=target_name(url),
            url=urllib.parse.urlunsplit(parts._replace(netloc=netloc)),
            username=username,
            password=password,
            password_file=password_file if parts.username is None else None,
        )

    def auth(self) -> httpx.BasicAuth | None:
        """The credentials to send; raises ScrapeError when the password file cannot be read."""
        if self.username is None:
            return None
        password = self.password or ""
        if self.password_file is not None:
            try:
                password = read_password(self.password_file)
            except OSError as error:
                reason = error.strerror or type(error).__name__
                raise ScrapeError("connect", f"{self.name}: scrape password file: {reason}") from None
            except ValueError as error:
                raise ScrapeError("connect", f"{self.name}: scrape password file: {error}") from None
        return httpx.BasicAuth(self.username, password)


def read_password(path: Path) -> str:
    """A password file's secret: its text without surrounding white space (a trailing newline
    is what ``echo`` and most secret stores leave); raises OSError or ValueError (blank)."""
    try:
        password = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    if not password:
        raise ValueError("it is blank")
    return password


async def fetch(
    client: httpx.AsyncClient, target: ScrapeTarget, *, deadline_seconds: float, limits: DecodeLimits
) -> str:
    """The target's exposition, through :func:`~kvlens.sources.bounded_http.exchange`: within
    ``deadline_seconds`` in all, inflated as it arrives and refused as soon as it crosses ``limits``
    (gzip is asked for, as vLLM honours it: about 10 times fewer bytes on the wire)."""
    name = target.name
    answer = await exchange(
        client,
        "GET",
        target.url,
        name=name,
        deadline_seconds=deadline_seconds,
        limits=limits,
        headers={"accept": "text/plain"},
        auth=target.auth(),
    )
    if answer.status != 200:
        raise ScrapeError("http_status", f"{name} answered {answer.status}")
    try:
        return answer.body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("parse", f"{name} sent invalid UTF-8") from None


def longest_line(text: str) -> int:
    """The length of the longest line, found without splitting (no copy of the text)."""
    longest = start = 0
    while (end := text.find("\n", start)) >= 0:
        longest = max(longest, end - start)
        start = end + 1
    return max(longest, len(text) - start)


def families(text: str) -> Iterator[Metric]:
    """The metric families of an engine's exposition, read within its limits by every reader (the
    sidecar's scrape, the experiment's sampler and block-size check): a line past
    :data:`MAX_LINE_CHARS` is ScrapeError("too_large") before any is parsed (the parser holds
    several times a line), text prometheus_client cannot read ScrapeError("parse")."""
    if longest_line(text) > MAX_LINE_CHARS:
        raise ScrapeError("too_large", f"a line of the exposition is longer than {MAX_LINE_CHARS} characters")
    try:
        yield from text_string_to_metric_families(text)
    except (ValueError, TypeError, IndexError, KeyError) as error:
        raise ScrapeError("parse", f"exposition does not parse: {type(error).__name__}") from None


def parse(text: str) -> EngineScrape:
    """The engine counters and the running batch in a vLLM exposition; raises ScrapeError."""
    counters: list[EngineSample] = []
    running: dict[str, float] = {}
    try:
        for family in families(text):
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
