"""The sources that run beside the HTTP app: engine /metrics scrapes (asyncio tasks) and file
tails (threads, since file I/O blocks). Started and stopped by the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import httpx

from kvlens.errors import ScrapeError
from kvlens.exporter.aggregator import Aggregator, ModelLabels
from kvlens.exporter.modelled import ModelledCauses
from kvlens.exporter.settings import SidecarSettings
from kvlens.exporter.upstream import UpstreamState
from kvlens.fleet.discovery import DnsTarget
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import Publisher
from kvlens.fleet.settings import KVEventsSettings, parse_dns_target, parse_shard
from kvlens.fleet.subscriber import KVEvents
from kvlens.records import Validated
from kvlens.sources import tail, vllm_metrics
from kvlens.sources.encoding import DecodeLimits
from kvlens.sources.settings import TailSetting

log = logging.getLogger(__name__)


def fleet_index(settings: KVEventsSettings) -> FleetIndex:
    """The KV events' block index as the settings size it."""
    return FleetIndex(
        hashes_alike=settings.kv_events_hashes_alike,
        remember_blocks=settings.kv_events_remember_blocks,
        max_held_blocks=settings.kv_events_max_held_blocks,
        shard=parse_shard(settings.kv_events_shard),
    )


def dns_target(text: str) -> DnsTarget:
    host, port, replay_port = parse_dns_target(text)
    return DnsTarget(host, port, replay_port=replay_port)


class BackgroundSources:
    def __init__(
        self, settings: SidecarSettings, aggregator: Aggregator, kv_events: KVEvents | None = None
    ) -> None:
        """``kv_events``: one fed in process (the demo), instead of the settings' subscriptions."""
        self.settings = settings
        self.aggregator = aggregator
        self.targets = {target.name: target for target in settings.scrape_targets_parsed()}
        self.upstream = (
            UpstreamState(
                tuple(self.targets),
                ModelLabels(settings, capacity=settings.upstream_max_models),
                max_series=settings.upstream_max_series,
            )
            if self.targets
            else None
        )
        self.tails = [tail.TailStatus(spec.path) for spec in settings.tails]
        self.kv_events = kv_events
        if kv_events is None and (settings.kv_events or settings.kv_events_dns):
            self.kv_events = KVEvents(
                [Publisher(p.name, p.endpoint, p.replay_endpoint, p.topic) for p in settings.kv_events],
                fleet_index(settings),
                settings.kv_events_reorder_seconds,
                dns=[dns_target(target) for target in settings.kv_events_dns],
                dns_interval_seconds=settings.kv_events_dns_interval_seconds,
                vanished_retention_seconds=settings.kv_events_vanished_retention_seconds,
            )
        self.modelled = (
            None
            if settings.modelled_capacity_blocks is None
            else ModelledCauses(
                settings.modelled_capacity_blocks,
                settings.modelled_block_size,
                max_replicas=settings.modelled_max_replicas,
                partial_last_block=settings.modelled_partial_last_block,
                remember_blocks=settings.kv_events_remember_blocks,
            )
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._threads: list[threading.Thread] = []
        self._stop_tails = threading.Event()
        self._stopping = False

    async def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        self._tasks = [asyncio.create_task(self._scrape_forever(target)) for target in self.targets.values()]
        self._threads = [
            self._follow(spec, status) for spec, status in zip(self.settings.tails, self.tails, strict=True)
        ]

    async def stop(self) -> None:
        self._stopping = True  # a scrape loop that lost its cancellation still ends at its next turn
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stop_tails.set()
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.stop)
        for thread in self._threads:  # each writes its last checkpoint as it ends
            await asyncio.to_thread(thread.join, 10)

    def count(self, validated: Validated, source: str) -> None:
        """Add records to the sums, and to the modelled caches when they are on."""
        self.aggregator.add(validated, source)
        if self.modelled is not None:
            self.modelled.add(validated.batch)

    def problems(self) -> list[str]:
        """Why the sidecar cannot keep its promises now (readiness fails while there are any)."""
        return [problem for status in self.tails for problem in status.problems()]

    async def _scrape_forever(self, scraped: vllm_metrics.ScrapeTarget) -> None:
        settings, upstream, target = self.settings, self.upstream, scraped.name
        assert upstream is not None
        # No ratio limit: the byte cap bounds memory, and a verbose engine may compress very well.
        limits = DecodeLimits(settings.scrape_max_bytes, math.inf, settings.max_gzip_members)
        async with httpx.AsyncClient(timeout=settings.scrape_timeout_seconds) as client:
            while not self._stopping:
                try:
                    text = await vllm_metrics.fetch(
                        client, scraped, deadline_seconds=settings.scrape_timeout_seconds, limits=limits
                    )
                    scrape = await asyncio.to_thread(vllm_metrics.parse, text)
                    upstream.record_scrape(target, scrape)
                except ScrapeError as error:
                    log.warning("kvlens: scrape of %s failed: %s", target, error)
                    upstream.record_failure(target, error.reason)
                except Exception:  # a bug must not end the scraping: count it as unparsable
                    log.exception("kvlens: scrape of %s failed", target)
                    upstream.record_failure(target, "parse")
                await asyncio.sleep(settings.scrape_interval_seconds)

    def _follow(self, spec: TailSetting, status: tail.TailStatus) -> threading.Thread:
        tailer = tail.Tailer(
            spec.path,
            tail.checkpoint_path(self.settings.state_dir, spec.path),
            max_line_bytes=self.settings.tail_max_line_bytes,
        )
        thread = threading.Thread(
            target=tail.follow,
            args=(
                tailer,
                spec.converter(),
                lambda validated: self.count(validated, "tail"),
                self._stop_tails,
            ),
            kwargs={"poll_seconds": self.settings.tail_poll_seconds, "status": status},
            name=f"kvlens-tail-{spec.path}",
            daemon=True,
        )
        thread.start()
        return thread
