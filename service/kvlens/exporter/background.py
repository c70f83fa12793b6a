"""The sources that run beside the HTTP app: engine /metrics scrapes (asyncio tasks) and file
tails (threads, since file I/O blocks). Started and stopped by the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import httpx

from kvlens.audit.probe import IsolationProbes
from kvlens.errors import ScrapeError
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.diagnoses import RequestDiagnoses
from kvlens.exporter.labels import ClosedLabels
from kvlens.exporter.modelled import ModelledCauses
from kvlens.exporter.settings import SidecarSettings
from kvlens.exporter.upstream import UpstreamState
from kvlens.fleet.discovery import DnsTarget
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.ordering import Publisher
from kvlens.fleet.settings import KVEventsSettings, parse_dns_target, parse_shard
from kvlens.fleet.subscriber import KVEvents
from kvlens.fleet.trtllm import MAX_BODY_BYTES, TrtllmFeed
from kvlens.records import Validated
from kvlens.sources import tail, vllm_metrics
from kvlens.sources.bounded_http import exchange
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
        require_cache_salt=settings.kv_events_require_cache_salt,
        sessions=settings.kv_events_sessions,
        group_kinds=settings.kv_events_group_kinds,
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
                ClosedLabels(settings.models, settings.upstream_max_models, settings.default_model),
                max_series=settings.upstream_max_series,
            )
            if self.targets
            else None
        )
        self.tails = [tail.TailStatus(spec.path) for spec in settings.tails]
        self.kv_events = kv_events
        subscribed = bool(settings.kv_events or settings.kv_events_dns)
        if kv_events is None and (subscribed or settings.kv_events_trtllm):
            self.kv_events = KVEvents(
                [Publisher(p.name, p.endpoint, p.replay_endpoint, p.topic) for p in settings.kv_events],
                fleet_index(settings),
                settings.kv_events_reorder_seconds,
                dns=[dns_target(target) for target in settings.kv_events_dns],
                dns_interval_seconds=settings.kv_events_dns_interval_seconds,
                vanished_retention_seconds=settings.kv_events_vanished_retention_seconds,
                in_process=not subscribed,  # TensorRT-LLM's only: drained over HTTP, no ZeroMQ
            )
        # TensorRT-LLM's events are drained over HTTP (kvlens.fleet.trtllm) into the same index
        self.trtllm = (
            [TrtllmFeed(self.kv_events.consumer, spec.name, spec.url) for spec in settings.kv_events_trtllm]
            if self.kv_events is not None
            else []
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
        self.diagnoses = RequestDiagnoses(
            settings.diagnosis_requests,
            settings.diagnosis_remember_blocks,
            settings.modelled_block_size,
            None if self.kv_events is None else self.kv_events.index,
        )
        targets = settings.targets()
        self.isolation = IsolationProbes(targets, settings.isolation_every_seconds) if targets else None
        self._tasks: list[asyncio.Task[None]] = []
        self._threads: list[threading.Thread] = []
        self._stop_tails = threading.Event()
        self._stopping = False

    async def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        self._tasks = [asyncio.create_task(self._scrape_forever(target)) for target in self.targets.values()]
        if self.isolation is not None:
            self.isolation.start()
        self._tasks += [asyncio.create_task(self._drain_forever(feed)) for feed in self.trtllm]
        self._threads = [
            self._follow(spec, status) for spec, status in zip(self.settings.tails, self.tails, strict=True)
        ]

    async def stop(self) -> None:
        self._stopping = True  # a scrape loop that lost its cancellation still ends at its next turn
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.isolation is not None:
            await self.isolation.stop()
        self._stop_tails.set()
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.stop)
        for thread in self._threads:  # each writes its last checkpoint as it ends
            await asyncio.to_thread(thread.join, 10)

    def count(self, validated: Validated, source: str) -> None:
        """Add records to the sums, to the requests' diagnoses, and to the modelled caches when
        they are on."""
        self.aggregator.add(validated, source)
        self.diagnoses.add(validated.batch)
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

    async def _drain_forever(self, feed: TrtllmFeed) -> None:
        """``POST URL/kv_cache_events`` every ``kv_events_trtllm_poll_seconds``, each answer read
        within the scrape's deadline and :data:`~kvlens.fleet.trtllm.MAX_BODY_BYTES`, then applied
        off the event loop. A drain that failed after the server emptied its queue loses those
        events: the next drain's event ids show the gap (counted missed)."""
        settings = self.settings
        limits = DecodeLimits(MAX_BODY_BYTES, math.inf, settings.max_gzip_members)
        url = f"{feed.url}/kv_cache_events"
        async with httpx.AsyncClient(timeout=settings.scrape_timeout_seconds) as client:
            while not self._stopping:
                try:
                    answer = await exchange(
                        client,
                        "POST",
                        url,
                        name=feed.name,
                        deadline_seconds=settings.scrape_timeout_seconds,
                        limits=limits,
                        headers={"accept": "application/json"},
                    )
                    if answer.status != 200:
                        raise ScrapeError("http_status", f"{feed.name} answered {answer.status}")
                    await asyncio.to_thread(feed.apply_body, bytes(answer.body))
                    feed.up(1)
                except ScrapeError as error:
                    log.warning("kvlens: drain of %s's KV cache events failed: %s", feed.name, error)
                    feed.up(0)
                except Exception:  # a bug must not end the draining
                    log.exception("kvlens: drain of %s's KV cache events failed", feed.name)
                    feed.up(0)
                await asyncio.sleep(settings.kv_events_trtllm_poll_seconds)

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
