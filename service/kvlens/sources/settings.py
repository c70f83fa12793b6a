"""The settings of the sources that run beside the sidecar: vLLM ``/metrics`` scrapes
(:class:`ScrapeSettings`) and followed JSON-lines files (:class:`TailSettings`)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvlens.sources import formats

if TYPE_CHECKING:
    from kvlens.sources import vllm_metrics


class TailSetting(BaseModel):
    """One followed glob of JSON-lines files (``--tail GLOB --format F``)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    path: str = Field(description="Glob of the files to follow; it must not match rotated copies.")
    format: str = Field("kvlens", description="kvlens, sglang or openai-usage (ignored with fields).")
    model: str | None = Field(None, description="`model` for lines that carry none (SGLang never does).")
    fields: dict[str, str] = Field({}, description="Record field -> dotted path, for other JSON logs.")
    missing_cached_is_zero: bool = Field(
        False, description="openai-usage: no prompt_tokens_details means 0 cached (vLLM < 0.24)."
    )

    @model_validator(mode="after")
    def _known_format(self) -> TailSetting:
        self.converter()  # raises ValueError for an unknown format or field
        return self

    def converter(self) -> formats.Converter:
        return formats.converter(
            self.format,
            model=self.model,
            fields=self.fields,
            missing_cached_is_zero=self.missing_cached_is_zero,
        )


def _redacted(url: str) -> str:
    """``url`` with the password of its userinfo as ``***``."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


class ScrapeSettings(BaseModel):
    """vLLM ``/metrics`` targets scraped for the engine's own counters, and their budgets."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    scrape_targets: list[str] = Field(
        [], description="vLLM `/metrics` URLs to scrape for the engine's own counters (`--scrape`)."
    )
    scrape_username: str | None = Field(
        None, description="Basic-auth user for the scrape targets (with `scrape_password_file`)."
    )
    scrape_password_file: Path | None = Field(
        None,
        description="File holding the scrape targets' basic-auth password, re-read at each scrape "
        "(instead of a password in the URL).",
    )
    scrape_interval_seconds: float = Field(15.0, gt=0, le=3600, description="Seconds between scrapes.")
    scrape_timeout_seconds: float = Field(
        5.0, gt=0, le=300, description="Hard deadline for a whole scrape (connect to last byte)."
    )
    scrape_max_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest scraped exposition.")
    upstream_max_models: int = Field(
        50, ge=1, le=10_000, description="Cap on `model` values of engine counters (a budget of their own)."
    )
    upstream_max_series: int = Field(
        1000, ge=1, le=1_000_000, description="Engine counter series followed per scrape target."
    )

    def __repr_args__(self) -> Any:
        # a scrape URL may carry its password: never in a repr, a traceback or a log line
        for name, value in super().__repr_args__():
            yield name, [_redacted(url) for url in value] if name == "scrape_targets" else value

    @field_validator("scrape_targets")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        # the messages never quote a URL: it may hold a password
        if not urls:  # every offline command: not the scrape client's import (httpx: ~0.5 CPU s)
            return urls
        from kvlens.sources import vllm_metrics  # httpx: imported when scraping is configured

        try:
            parts = [urllib.parse.urlsplit(url) for url in urls]
            names = [vllm_metrics.target_name(url) for url in urls]
            for part in parts:
                _ = part.port  # an invalid port raises here rather than at the first scrape
        except ValueError:
            raise ValueError("scrape targets must be valid URLs") from None
        if any(part.scheme not in ("http", "https") or not part.hostname for part in parts):
            raise ValueError("scrape targets must be http(s) URLs")
        if len(set(names)) != len(names):
            raise ValueError("scrape targets must be distinct by host, port and path")
        return urls

    @field_validator("scrape_password_file")
    @classmethod
    def _readable_password(cls, path: Path | None) -> Path | None:
        if path is not None:
            from kvlens.sources import vllm_metrics

            try:
                vllm_metrics.read_password(path)
            except OSError as error:
                raise ValueError(f"cannot read it: {error.strerror or type(error).__name__}") from None
        return path

    @model_validator(mode="after")
    def _scrape_credentials(self) -> ScrapeSettings:
        if (self.scrape_username is None) != (self.scrape_password_file is None):
            raise ValueError("scrape_username and scrape_password_file go together")
        if self.scrape_username is not None and any(
            urllib.parse.urlsplit(url).username is not None for url in self.scrape_targets
        ):
            raise ValueError("give scrape credentials in the URL or in scrape_username, not both")
        return self

    def scrape_targets_parsed(self) -> list[vllm_metrics.ScrapeTarget]:
        """Each scrape URL taken apart: its name, the URL to fetch, its credentials."""
        from kvlens.sources import vllm_metrics

        return [
            vllm_metrics.ScrapeTarget.from_url(url, self.scrape_username, self.scrape_password_file)
            for url in self.scrape_targets
        ]


class TailSettings(BaseModel):
    """JSON-lines files followed, how often, and where their checkpoints are kept."""

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)

    tails: list[TailSetting] = Field(
        [], description="JSON-lines files to follow (`--tail GLOB --format F`), as a list of objects."
    )
    tail_poll_seconds: float = Field(1.0, gt=0, le=60, description="Seconds between polls of followed files.")
    tail_max_line_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Longer lines are counted from their small top-level fields, or skipped (too_long).",
    )
    state_dir: Path = Field(
        Path("~/.local/state/kvlens"),
        description="Where tail checkpoints are kept: a writable volume (the image uses /var/lib/kvlens).",
    )

    @field_validator("state_dir")
    @classmethod
    def _expand_home(cls, path: Path) -> Path:
        return path.expanduser()
