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
from kvlens.config import ModelShapeSetting
from kvlens.exporter import metrics
from kvlens.exporter.aggregator import TTFT_COMPONENTS, Aggregator, Histograms, Snapshot
from kvlens.exporter.upstream import UpstreamState

log = logging.getLogger(__name__)
_go_float = cast(Callable[[float], str], floatToGoString)  # how prometheus_client writes `le`


class KVLensCollector(Collector):
    def __init__(self, aggregator: Aggregator, upstream: UpstreamState | None = None) -> None:
        self.aggregator = aggregator
        self.upstream = upstream
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
        if self.upstream is not None:
            yield from self._safely(_upstream_families, self.upstream)
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
    (metrics.PROMPT_WORK, "prompt_work"),
    (metrics.REUSED_WORK, "reused_work"),
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
    rows = ((row, list(snapshot.group_labels(row * 2)[:2])) for row in model_lengths)
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
    return [*families, up, running, errors]


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
        if model not in snapshot.context_tokens:
            continue
        context = snapshot.context_tokens[model]
        batch = max(running.get(model, 1.0), 1.0)
        per_token = bandwidth.kv_bytes_per_token(
            shape.layers, shape.kv_heads, shape.head_dim, shape.kv_dtype_bytes
        )
        ratio = bandwidth.quantized_weight_ratio(shape.quantized_fraction, 4, shape.group_size)
        step = bandwidth.compare_step(
            weight_bytes_16=shape.weight_bytes,
            weight_bytes_q=shape.weight_bytes * ratio,
            kv_bytes_per_token_=per_token,
            batch=batch,
            context_tokens=context,
            bandwidth=1.0,  # memory-bound: the speedup does not depend on it
        )
        share = bandwidth.weight_share(
            shape.weight_bytes, batch, bandwidth.kv_bytes_per_sequence(context, per_token)
        )
        for spec, value in (
            (metrics.DECODE_CONTEXT, context),
            (metrics.DECODE_BATCH, batch),
            (metrics.DECODE_WEIGHT_SHARE, share),
            (metrics.W4A16_SPEEDUP, step.speedup),
        ):
            families[spec.name].add_metric([model], value)
    return list(families.values())
