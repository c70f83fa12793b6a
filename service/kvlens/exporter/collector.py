"""The prometheus_client collector: reads a snapshot at scrape time, does no I/O, never raises.

Each family is built on its own; one that fails is left out and counted in
``kvlens_collector_errors_total`` so that a bug in one family never blanks ``/metrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvlens import __version__, bandwidth
from kvlens.accounting import ModelShapeSetting
from kvlens.audit.probe import IsolationProbes
from kvlens.definitions import DEFAULT_COST_MODEL, UNITS, CostModel
from kvlens.exporter import metrics
from kvlens.exporter.aggregator import CACHE_LABELS, TTFT_COMPONENTS, Aggregator, Histograms, Snapshot
from kvlens.exporter.background import BackgroundSources
from kvlens.exporter.diagnoses import RequestDiagnoses
from kvlens.exporter.modelled import ModelledCauses
from kvlens.exporter.runtime import LAG_BUCKETS, ServiceHealth
from kvlens.exporter.tenants import TenantAccounts
from kvlens.exporter.upstream import UpstreamState
from kvlens.fleet.causes import CAUSES
from kvlens.fleet.subscriber import KVEvents
from kvlens.reduce import pack_hit
from kvlens.sources.tail import SKIP_REASONS, TailStatus

log = logging.getLogger(__name__)
_go_float = cast(Callable[[float], str], floatToGoString)  # how prometheus_client writes `le`


class KVLensCollector(Collector):
    def __init__(
        self,
        aggregator: Aggregator,
        background: BackgroundSources | None = None,
        health: ServiceHealth | None = None,
    ) -> None:
        self.aggregator = aggregator
        self.upstream = background.upstream if background is not None else None
        self.tails = background.tails if background is not None else []
        self.kv_events = background.kv_events if background is not None else None
        self.modelled = background.modelled if background is not None else None
        self.diagnoses = background.diagnoses if background is not None else None
        self.isolation = background.isolation if background is not None else None
        self.health = health
        self.errors = 0

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            snapshot = self.aggregator.snapshot()
        except Exception:
            log.exception("kvlens collector: snapshot failed")
            self.errors += 1
            yield self._errors_family()
            return
        builders: list[Callable[[Snapshot], Metric]] = [
            *(_group_counter(spec, attribute) for spec, attribute in _GROUP_COUNTER_FIELDS),
            *(
                _work_counter(spec, attribute, unit)
                for unit, (prompt, reused) in metrics.WORK.items()
                for spec, attribute in ((prompt, "prompt_work"), (reused, "reused_work"))
            ),
            *(_latency_histogram(spec, field) for spec, field in _LATENCY_FIELDS),
            _reuse_ratio,
            _ttft_components,
            _ttft_overlap,
            _health_counter(metrics.RECEIVED, lambda snap: snap.received),
            _health_counter(metrics.REJECTED, lambda snap: snap.rejected),
            _health_counter(metrics.DROPPED, lambda snap: snap.dropped),
            _health_counter(metrics.UNKNOWN_FIELDS, lambda snap: snap.unknown_fields),
            _health_counter(metrics.OVERFLOW, lambda snap: {(): snap.series_overflow}),
            _build_info,
        ]
        for build in builders:
            yield from self._safely(build, snapshot)
        if self.health is not None:
            yield from self._safely(_service_families, self.health)
        if self.upstream is not None:
            yield from self._safely(_upstream_families, self.upstream)
        if self.tails:
            yield from self._safely(_tail_families, self.tails)
        if self.kv_events is not None:
            settings = self.aggregator.settings
            cost = settings.cost_model_for(settings.kv_events_model)
            yield from self._safely(lambda kv_events: kv_families(kv_events, cost), self.kv_events)
        if self.modelled is not None:
            yield from self._safely(_modelled_families, self.modelled)
        if self.isolation is not None:
            yield from self._safely(_isolation_families, self.isolation)
        yield from self._safely(_tenant_families, self.aggregator.tenants)
        if self.diagnoses is not None:
            yield from self._safely(_miss_family, self.diagnoses)
        if self.aggregator.settings.model_shapes:
            shapes = self.aggregator.settings.model_shapes
            yield from self._safely(lambda snap: _decode_families(snap, self.upstream, shapes), snapshot)
        yield self._errors_family()

    def _safely(self, build: Callable[[Any], Iterable[Metric] | Metric], state: Any) -> Iterator[Metric]:
        """The families ``build`` makes of ``state``, or none (counted) when it raises."""
        try:
            built = build(state)
            families = [built] if isinstance(built, Metric) else list(built)
        except Exception:
            log.exception("kvlens collector: a metric family failed to render")
            self.errors += 1
            return
        yield from families

    def _errors_family(self) -> Metric:
        family = CounterMetricFamily(
            metrics.SCRAPE_ERRORS.name, metrics.SCRAPE_ERRORS.help, labels=metrics.SCRAPE_ERRORS.labels
        )
        family.add_metric([], self.errors)
        return family


_GROUP_COUNTER_FIELDS = (
    (metrics.REQUESTS, "requests"),
    (metrics.PROMPT_TOKENS, "prompt_tokens"),
    (metrics.CACHED_TOKENS, "cached_tokens"),
)
_LATENCY_FIELDS = (
    (metrics.QUEUE, "queue_seconds"),
    (metrics.PREFILL, "prefill_seconds"),
    (metrics.TTFT, "ttft_seconds"),
    (metrics.E2E, "e2e_seconds"),
)


def _counter(spec: metrics.MetricSpec) -> CounterMetricFamily:
    return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)


def _group_counter(spec: metrics.MetricSpec, attribute: str) -> Callable[[Snapshot], Metric]:
    def build(snapshot: Snapshot) -> Metric:
        family = _counter(spec)
        values = getattr(snapshot.state, attribute).tolist()
        for group, labels in snapshot.active_groups:
            family.add_metric(labels, values[group])
        return family

    return build


def _work_counter(spec: metrics.MetricSpec, attribute: str, unit: str) -> Callable[[Snapshot], Metric]:
    """A modelled-work counter of one unit: the groups whose requests had work in it (and the
    allow-listed models whose cost model counts in it, from the start)."""
    index = UNITS.index(unit)

    def build(snapshot: Snapshot) -> Metric:
        family = _counter(spec)
        values = getattr(snapshot.state, attribute)[index].tolist()
        counted = snapshot.state.work_requests[index]
        for group, labels in snapshot.active_groups:
            if counted[group] or snapshot.declared_unit(group) == unit:
                family.add_metric(labels, values[group])
        return family

    return build


def _histogram_family(
    spec: metrics.MetricSpec,
    hist: Histograms,
    edges: list[float],
    rows: Iterable[tuple[int, list[str]]],
) -> Metric:
    family = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
    bounds = [_go_float(edge) for edge in edges] + ["+Inf"]
    cumulative = np.cumsum(hist.counts, axis=1)
    sums = hist.sums.tolist()
    for row, labels in rows:
        counts = cumulative[row].tolist()
        if counts[-1] == 0:
            continue
        family.add_metric(labels, list(zip(bounds, counts, strict=True)), sums[row])
    return family


def _latency_histogram(spec: metrics.MetricSpec, field: str) -> Callable[[Snapshot], Metric]:
    def build(snapshot: Snapshot) -> Metric:
        return _histogram_family(
            spec, snapshot.state.latency[field], snapshot.latency_buckets, snapshot.active_groups
        )

    return build


def _reuse_ratio(snapshot: Snapshot) -> Metric:
    model_lengths = np.flatnonzero(snapshot.state.reuse.counts.sum(axis=1)).tolist()
    # a (model, prompt_len) row's labels: those of its miss code, less the cache label
    rows = ((row, list(snapshot.group_labels(pack_hit(row, False))[:2])) for row in model_lengths)
    return _histogram_family(metrics.REUSE_RATIO, snapshot.state.reuse, snapshot.reuse_buckets, rows)


def _ttft_components(snapshot: Snapshot) -> Metric:
    family = _counter(metrics.TTFT_COMPONENT)
    seen = snapshot.state.ttft_components
    for slot in np.flatnonzero(seen.sum(axis=1) > 0).tolist():
        for column, component in enumerate(TTFT_COMPONENTS):
            family.add_metric([snapshot.model_labels[slot], component], float(seen[slot, column]))
    return family


def _ttft_overlap(snapshot: Snapshot) -> Metric:
    family = _counter(metrics.TTFT_OVERLAP)
    for slot in np.flatnonzero(snapshot.state.ttft_components.sum(axis=1) > 0).tolist():
        family.add_metric([snapshot.model_labels[slot]], float(snapshot.state.ttft_overlap[slot]))
    return family


def _health_counter(
    spec: metrics.MetricSpec, counts: Callable[[Snapshot], Mapping[Any, int]]
) -> Callable[[Snapshot], Metric]:
    """A counter family from a mapping of label value(s) to count."""

    def build(snapshot: Snapshot) -> Metric:
        family = _counter(spec)
        for key, count in sorted(counts(snapshot).items()):
            family.add_metric(list(key) if isinstance(key, tuple) else [key], count)
        return family

    return build


def _build_info(snapshot: Snapshot) -> Metric:
    family = GaugeMetricFamily(
        metrics.BUILD_INFO.name, metrics.BUILD_INFO.help, labels=metrics.BUILD_INFO.labels
    )
    family.add_metric([__version__], 1)
    return family


def _upstream_families(upstream: UpstreamState) -> list[Metric]:
    snapshot = upstream.snapshot()
    families: list[Metric] = []
    for counter, spec in metrics.ENGINE_COUNTERS.items():
        family = _counter(spec)
        for (name, target, model), value in sorted(snapshot.counters.items()):
            if name == counter:
                family.add_metric([target, model], value)
        families.append(family)
    up = GaugeMetricFamily(
        metrics.UPSTREAM_UP.name, metrics.UPSTREAM_UP.help, labels=metrics.UPSTREAM_UP.labels
    )
    for target, value in sorted(snapshot.up.items()):
        up.add_metric([target], value)
    running = GaugeMetricFamily(
        metrics.ENGINE_RUNNING.name, metrics.ENGINE_RUNNING.help, labels=metrics.ENGINE_RUNNING.labels
    )
    for (target, model), value in sorted(snapshot.running.items()):
        running.add_metric([target, model], value)
    errors = _counter(metrics.UPSTREAM_ERRORS)
    for (target, reason), count in sorted(snapshot.errors.items()):
        errors.add_metric([target, reason], count)
    scrapes = _counter(metrics.UPSTREAM_SCRAPES)
    for target, count in sorted(snapshot.scrapes.items()):
        scrapes.add_metric([target], count)
    rejected = _counter(metrics.UPSTREAM_REJECTED)
    for (target, reason), count in sorted(snapshot.rejected.items()):
        rejected.add_metric([target, reason], count)
    return [*families, up, running, errors, scrapes, rejected]


def _isolation_families(probes: IsolationProbes) -> list[Metric]:
    snapshot = probes.snapshot()
    result, last = _gauge(metrics.ISOLATION_RESULT), _gauge(metrics.ISOLATION_LAST_SUCCESS)
    for (target, case), value in sorted(snapshot.results.items()):
        result.add_metric([target, case], value)
    for target, seconds in sorted(snapshot.last_success.items()):
        last.add_metric([target], seconds)
    return [result, last]


def kv_families(kv_events: KVEvents, cost: CostModel = DEFAULT_COST_MODEL) -> list[Metric]:
    """``cost``: the followed fleet's model's cost model (``kv_events_model``), for the work."""
    snapshot = kv_events.snapshot()
    index, publishers = snapshot.index, snapshot.publishers
    recomputed = _counter(metrics.KV_RECOMPUTED_TOKENS)
    work, depth_unknown = _counter(metrics.KV_RECOMPUTED_WORK), _counter(metrics.KV_DEPTH_UNKNOWN)
    recomputed_work = index.recomputed_work(cost)
    for replica in sorted(publishers):  # every cause of every replica, 0 until it happens
        for cause in CAUSES:
            recomputed.add_metric([replica, cause], index.recomputed_tokens.get((replica, cause), 0))
            work.add_metric([replica, cause, cost.unit], recomputed_work.get((replica, cause), 0.0))
            depth_unknown.add_metric([replica, cause], index.depth_unknown_tokens.get((replica, cause), 0))
    stored, removed = _counter(metrics.KV_BLOCKS_STORED), _counter(metrics.KV_BLOCKS_REMOVED)
    held = _gauge(metrics.KV_BLOCKS_HELD)
    for family, table in ((stored, index.stored), (removed, index.removed), (held, index.held)):
        for (replica, medium), value in sorted(table.items()):
            family.add_metric([replica, medium], value)
    fleet = _gauge(metrics.KV_FLEET_BLOCKS)
    fleet.add_metric(["distinct"], index.distinct_blocks)
    fleet.add_metric(["duplicated"], index.duplicated_blocks)
    events, rejected = _counter(metrics.KV_EVENTS), _counter(metrics.KV_REJECTED)
    per_publisher = {
        spec.name: _gauge(spec) if spec.kind == "gauge" else _counter(spec)
        for spec in (
            metrics.KV_BATCHES,
            metrics.KV_GAPS,
            metrics.KV_JUMPS,
            metrics.KV_MISSED,
            metrics.KV_REPLAYS,
            metrics.KV_REPLAYED,
            metrics.KV_RESTARTS,
            metrics.KV_PUBLISHER_UP,
        )
    }
    for replica, status in sorted(publishers.items()):
        for kind, count in sorted(status.events.items()):
            events.add_metric([replica, kind], count)
        for reason, count in (
            ("malformed_payload", status.malformed_payloads),
            ("malformed_event", status.malformed_events),
            ("unknown_event", status.unknown_events),
            ("unknown_field", status.unknown_fields),
            ("other_group", status.other_group_events),
            ("replica_limit", status.refused_batches),
            ("bad_timestamp", status.bad_timestamps),
            ("error", status.errors),
        ):
            rejected.add_metric([replica, reason], count)
        for spec, value in (
            (metrics.KV_BATCHES, status.batches),
            (metrics.KV_GAPS, status.gaps),
            (metrics.KV_JUMPS, status.jumps),
            (metrics.KV_MISSED, status.missed),
            (metrics.KV_REPLAYS, status.replays),
            (metrics.KV_REPLAYED, status.replayed),
            (metrics.KV_RESTARTS, status.restarts),
            (metrics.KV_PUBLISHER_UP, status.up),
        ):
            per_publisher[spec.name].add_metric([replica], value)
    singles: list[Metric] = []
    for spec, value in (
        (metrics.KV_INDEX_MEMORY, index.memory_bytes),
        (metrics.KV_REMEMBERED, index.remembered_blocks),
        (metrics.KV_FORGOTTEN, index.forgotten_blocks),
        (metrics.KV_UNTRACKED, index.untracked_blocks),
        (metrics.KV_UNKNOWN_REMOVED, index.unknown_removed),
    ):
        family = _gauge(spec) if spec.kind == "gauge" else _counter(spec)
        family.add_metric([], value)
        singles.append(family)
    dns_replicas, dns_failures = _gauge(metrics.KV_DNS_REPLICAS), _counter(metrics.KV_DNS_FAILURES)
    for name, (replicas, failures) in sorted(snapshot.dns.items()):
        dns_replicas.add_metric([name], replicas)
        dns_failures.add_metric([name], failures)
    families = [recomputed, work, depth_unknown, stored, removed, held, fleet, events, rejected]
    families += [*per_publisher.values(), *singles]
    if kv_events.index.require_cache_salt:  # every replica's series, 0 until an unsalted store
        unsalted = _counter(metrics.KV_UNSALTED_BLOCKS)
        for replica in sorted(publishers):
            unsalted.add_metric([replica], index.unsalted_blocks.get(replica, 0))
        families.append(unsalted)
    return families + ([dns_replicas, dns_failures] if snapshot.dns else [])


def _miss_family(diagnoses: RequestDiagnoses) -> Metric:
    family = _counter(metrics.REQUEST_MISSES)
    for cause, count in diagnoses.counts().items():
        family.add_metric([cause], count)
    return family


def _modelled_families(modelled: ModelledCauses) -> list[Metric]:
    snapshot = modelled.snapshot()
    recomputed = _counter(metrics.KV_MODELLED_RECOMPUTED_TOKENS)
    for replica in sorted(snapshot.replicas):  # every cause of every replica, 0 until it happens
        for cause in CAUSES:
            recomputed.add_metric([replica, cause], snapshot.index.recomputed_tokens.get((replica, cause), 0))
    records = _counter(metrics.KV_MODELLED_RECORDS)
    for outcome, count in snapshot.records.items():
        records.add_metric([outcome], count)
    return [recomputed, records]


def _tenant_families(tenants: TenantAccounts) -> list[Metric]:
    """The per-tenant families once a tenant is seen (or allow-listed); the cross-tenant ones
    with tenant_remember_blocks, from the start."""
    snapshot = tenants.snapshot()
    families: list[Metric] = []
    if snapshot.tenants:
        requests, prompt, cached = (
            _counter(spec)
            for spec in (metrics.TENANT_REQUESTS, metrics.TENANT_PROMPT_TOKENS, metrics.TENANT_CACHED_TOKENS)
        )
        prompt_work, reused_work = _counter(metrics.TENANT_PROMPT_WORK), _counter(metrics.TENANT_REUSED_WORK)
        for row, tenant in enumerate(snapshot.tenants):
            for hit, cache in enumerate(CACHE_LABELS):
                requests.add_metric([tenant, cache], int(snapshot.requests[row, hit]))
            prompt.add_metric([tenant], int(snapshot.prompt_tokens[row]))
            cached.add_metric([tenant], int(snapshot.cached_tokens[row]))
            for unit_index, unit in enumerate(UNITS):
                if snapshot.work_requests[unit_index, row]:
                    prompt_work.add_metric([tenant, unit], float(snapshot.prompt_work[unit_index, row]))
                    reused_work.add_metric([tenant, unit], float(snapshot.reused_work[unit_index, row]))
        overflow = _counter(metrics.TENANT_OVERFLOW)
        overflow.add_metric([], snapshot.overflow)
        families += [requests, prompt, cached, prompt_work, reused_work, overflow]
    if snapshot.remembered_blocks is not None:
        cross = _counter(metrics.CROSS_TENANT_TOKENS)
        for row, tenant in enumerate(snapshot.tenants):
            cross.add_metric([tenant], int(snapshot.cross_tenant_tokens[row]))
        remembered, forgotten = _gauge(metrics.TENANT_REMEMBERED), _counter(metrics.TENANT_FORGOTTEN)
        remembered.add_metric([], snapshot.remembered_blocks)
        forgotten.add_metric([], snapshot.forgotten_blocks)
        families += [cross, remembered, forgotten]
    return families


def _gauge(spec: metrics.MetricSpec) -> GaugeMetricFamily:
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


def _tail_families(tails: list[TailStatus]) -> list[Metric]:
    ok, failures = _gauge(metrics.TAIL_CHECKPOINT_OK), _counter(metrics.TAIL_CHECKPOINT_FAILURES)
    shortened, ignored = _counter(metrics.TAIL_SHORTENED), _counter(metrics.TAIL_IGNORED)
    skipped = _counter(metrics.TAIL_SKIPPED)
    for status in tails:
        ok.add_metric([status.pattern], 1 if status.checkpoint_ok else 0)
        failures.add_metric([status.pattern], status.checkpoint_failures)
        shortened.add_metric([status.pattern], status.lines_shortened)
        ignored.add_metric([status.pattern], status.lines_ignored)
        for reason in SKIP_REASONS:
            skipped.add_metric([status.pattern, reason], status.files_skipped[reason])
    return [ok, failures, shortened, ignored, skipped]


def _service_families(health: ServiceHealth) -> list[Metric]:
    in_flight = _gauge(metrics.INGEST_IN_FLIGHT)
    in_flight.add_metric([], health.arriving.bodies + health.gate.in_flight)
    arriving_bytes = _gauge(metrics.INGEST_ARRIVING_BYTES)
    arriving_bytes.add_metric([], health.arriving.bytes)
    refused = _counter(metrics.INGEST_REFUSED)
    for reason in INGEST_REFUSALS:
        refused.add_metric([reason], health.refused[reason])
    ingest_open = _gauge(metrics.INGEST_OPEN)
    ingest_open.add_metric([], 1 if health.ingest_open else 0)
    families: list[Metric] = [in_flight, arriving_bytes, refused, ingest_open]
    if health.connections is not None:
        connections = _gauge(metrics.CONNECTIONS_OPEN)
        connections.add_metric([], health.connections.open)
        closed = _counter(metrics.CONNECTIONS_CLOSED)
        for reason in ("header_timeout", "over_capacity", "write_timeout"):
            closed.add_metric([reason], health.connections.closed[reason])
        families += [connections, closed]
    lag = HistogramMetricFamily(metrics.LOOP_LAG.name, metrics.LOOP_LAG.help)
    counts, total = health.loop_lag.snapshot()
    bounds = [_go_float(edge) for edge in LAG_BUCKETS] + ["+Inf"]
    lag.add_metric([], list(zip(bounds, counts, strict=True)), total)
    families.append(lag)
    return families


# Refusals a sender retries (503: no room now, or this batch id is in progress); the others lose
# the request's records, and the KVLensIngestRefused alert counts only those.
RETRIED_REFUSALS = ("busy", "displaced", "batch_in_progress")
INGEST_REFUSALS = (
    *RETRIED_REFUSALS,
    "unauthorized",
    "too_large",
    "too_many_records",
    "compression_bomb",
    "unsupported_encoding",
    "unsupported_media_type",
    "undecodable",
    "too_slow",
    "client_disconnected",
)


def _decode_families(
    snapshot: Snapshot, upstream: UpstreamState | None, shapes: Mapping[str, ModelShapeSetting]
) -> list[Metric]:
    """The live W4A16 estimate per model with a configured shape (kvlens.bandwidth): the batch is
    the engine's running requests when kvlens scrapes it, else 1; the context is the recent mean."""
    running: dict[str, float] = {}
    if upstream is not None:
        for (_, model), value in upstream.snapshot().running.items():
            running[model] = running.get(model, 0.0) + value
    families = {
        spec.name: GaugeMetricFamily(spec.name, spec.help, labels=spec.labels) for spec in metrics.DECODE
    }
    for model, shape in sorted(shapes.items()):
        weight_bytes = shape.decode_weight_bytes()
        if model not in snapshot.context_tokens or weight_bytes is None:
            continue
        context = snapshot.context_tokens[model]
        batch = max(running.get(model, 1.0), 1.0)
        per_token = shape.shape().kv_bytes_per_token
        ratio = bandwidth.quantized_weight_ratio(shape.quantized_fraction, 4, shape.group_size)
        step = bandwidth.compare_step(
            weight_bytes_16=weight_bytes,
            weight_bytes_q=weight_bytes * ratio,
            kv_bytes_per_token_=per_token,
            batch=batch,
            context_tokens=context,
            bandwidth=1.0,  # memory-bound: the speedup does not depend on it
        )
        share = bandwidth.weight_share(
            weight_bytes, batch, bandwidth.kv_bytes_per_sequence(context, per_token)
        )
        for spec, value in (
            (metrics.DECODE_CONTEXT, context),
            (metrics.DECODE_BATCH, batch),
            (metrics.DECODE_WEIGHT_SHARE, share),
            (metrics.W4A16_SPEEDUP, step.speedup),
        ):
            families[spec.name].add_metric([model], value)
    return list(families.values())
