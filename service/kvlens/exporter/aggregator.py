"""Running sums behind the exported counters and histograms.

State is a set of dense numpy arrays indexed by group (model x prompt_len x cache), sized once
from the label caps, so memory depends on the number of series and never on the number of
records. A batch is reduced with ``np.bincount`` outside the lock and added under it; a scrape
copies the arrays under the same lock (:meth:`Aggregator.snapshot`) and formats outside it.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens import definitions
from kvlens.definitions import UNITS, prompt_length_labels
from kvlens.exporter.labels import OTHER_MODEL, ClosedLabels
from kvlens.exporter.settings import SidecarSettings
from kvlens.exporter.tenants import TenantAccounts
from kvlens.records import REASONS, RecordBatch, Validated
from kvlens.reduce import HIT_CODES, Reduced, codes_of, pack_hit, prefixes_of, reduce, unpack_hit

Int64Array = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

CONTEXT_WINDOW = 1000  # requests: the weight of the context-length mean
CACHE_LABELS = ("miss", "hit")
TTFT_COMPONENTS = ("queue", "prefill", "other")
LATENCY_FIELDS = ("queue_seconds", "prefill_seconds", "ttft_seconds", "e2e_seconds")


@dataclass
class Histograms:
    """Non-cumulative bucket counts (last column is +Inf) and sums, one row per group."""

    counts: Int64Array
    sums: FloatArray

    @classmethod
    def zeros(cls, rows: int, buckets: int) -> Histograms:
        return cls(np.zeros((rows, buckets + 1), np.int64), np.zeros(rows, np.float64))

    def copy(self) -> Histograms:
        return Histograms(self.counts.copy(), self.sums.copy())

    def __iadd__(self, other: Histograms) -> Histograms:
        self.counts += other.counts
        self.sums += other.sums
        return self


@dataclass
class GroupState:
    """The running sums: per group (model x prompt_len x cache) unless noted."""

    requests: Int64Array
    prompt_tokens: Int64Array
    cached_tokens: Int64Array
    prompt_work: FloatArray  # per unit (definitions.UNITS) x group
    reused_work: FloatArray  # per unit x group
    work_requests: Int64Array  # per unit x group: requests whose work is in that unit
    latency: dict[str, Histograms]
    reuse: Histograms  # per model x prompt_len
    ttft_components: FloatArray  # per model x component
    ttft_overlap: Int64Array  # per model

    @classmethod
    def zeros(cls, groups: int, model_slots: int, latency_buckets: int, reuse_buckets: int) -> GroupState:
        return cls(
            requests=np.zeros(groups, np.int64),
            prompt_tokens=np.zeros(groups, np.int64),
            cached_tokens=np.zeros(groups, np.int64),
            prompt_work=np.zeros((len(UNITS), groups), np.float64),
            reused_work=np.zeros((len(UNITS), groups), np.float64),
            work_requests=np.zeros((len(UNITS), groups), np.int64),
            latency={name: Histograms.zeros(groups, latency_buckets) for name in LATENCY_FIELDS},
            reuse=Histograms.zeros(prefixes_of(groups), reuse_buckets),
            ttft_components=np.zeros((model_slots, len(TTFT_COMPONENTS)), np.float64),
            ttft_overlap=np.zeros(model_slots, np.int64),
        )

    def __iadd__(self, other: GroupState) -> GroupState:
        for name in (
            "requests",
            "prompt_tokens",
            "cached_tokens",
            "prompt_work",
            "reused_work",
            "work_requests",
        ):
            getattr(self, name).__iadd__(getattr(other, name))
        for name, hist in other.latency.items():
            self.latency[name] += hist
        self.reuse += other.reuse
        self.ttft_components += other.ttft_components
        self.ttft_overlap += other.ttft_overlap
        return self

    def copy(self) -> GroupState:
        return GroupState(
            requests=self.requests.copy(),
            prompt_tokens=self.prompt_tokens.copy(),
            cached_tokens=self.cached_tokens.copy(),
            prompt_work=self.prompt_work.copy(),
            reused_work=self.reused_work.copy(),
            work_requests=self.work_requests.copy(),
            latency={name: hist.copy() for name, hist in self.latency.items()},
            reuse=self.reuse.copy(),
            ttft_components=self.ttft_components.copy(),
            ttft_overlap=self.ttft_overlap.copy(),
        )


@dataclass
class Snapshot:
    """A consistent copy of the state, for one scrape or one summary."""

    model_labels: list[str]
    prompt_len_labels: list[str]
    latency_buckets: list[float]
    reuse_buckets: list[float]
    state: GroupState
    received: dict[str, int]
    rejected: dict[tuple[str, str], int]
    dropped: dict[str, int]
    unknown_fields: dict[str, int]
    series_overflow: int
    context_tokens: dict[str, float]  # model -> recent mean of prompt + output tokens
    declared_models: int = 0  # allow-listed models: their groups are exported from the start
    declared_units: list[str] = field(default_factory=list)  # the unit of each one's cost model

    def declared_unit(self, group: int) -> str | None:
        """The cost model unit of the allow-listed model of a flat group index, if it is one."""
        slot = group // (len(self.prompt_len_labels) * 2)
        return self.declared_units[slot] if slot < self.declared_models else None

    @functools.cached_property
    def active_groups(self) -> list[tuple[int, list[str]]]:
        """(group index, [model, prompt_len, cache]) of every group that has seen a request, and
        of every group of an allow-listed model, so that rate() never loses a first increment."""
        declared = codes_of(self.declared_models * len(self.prompt_len_labels))
        groups = sorted({*range(declared), *np.flatnonzero(self.state.requests).tolist()})
        return [(group, list(self.group_labels(group))) for group in groups]

    def group_labels(self, group: int) -> tuple[str, str, str]:
        """(model, prompt_len, cache) of a flat group index."""
        model_len, hit = unpack_hit(group)
        model, length = divmod(model_len, len(self.prompt_len_labels))
        return self.model_labels[model], self.prompt_len_labels[length], CACHE_LABELS[hit]

    def totals(self) -> definitions.Totals:
        """Fleet-wide sums since start (ratios of these are lifetime; Prometheus takes windows)."""
        state = self.state
        return definitions.Totals(
            requests=int(state.requests.sum()),
            hit_requests=int(state.requests[HIT_CODES].sum()),
            prompt_tokens=int(state.prompt_tokens.sum()),
            cached_tokens=int(state.cached_tokens.sum()),
            prompt_work=tuple(state.prompt_work.sum(axis=1).tolist()),
            reused_work=tuple(state.reused_work.sum(axis=1).tolist()),
        )


@dataclass
class _HealthCounts:
    received: Counter[str] = field(default_factory=Counter)
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    unknown_fields: Counter[str] = field(default_factory=Counter)
    series_overflow: int = 0


class Aggregator:
    """Adds validated batches into the running sums. Thread-safe."""

    def __init__(self, settings: SidecarSettings, extra_sources: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.sources = ("push", "vllm_plugin", "otlp", *(("tail",) if settings.tails else ()), *extra_sources)
        self._lock = threading.Lock()
        self._models = ClosedLabels(settings.models, settings.max_models, settings.default_model)
        self._length_edges = np.asarray(settings.prompt_length_edges, np.int64)
        self._length_labels = prompt_length_labels(settings.prompt_length_edges)
        self._latency_edges = np.asarray(settings.latency_buckets_seconds, np.float64)
        self._reuse_edges = np.asarray(settings.reuse_ratio_buckets, np.float64)
        self._model_slots = self._models.capacity + 1  # + other
        self._groups = codes_of(self._model_slots * len(self._length_labels))
        self._state = GroupState.zeros(
            self._groups, self._model_slots, self._latency_edges.size, self._reuse_edges.size
        )
        self._health = _HealthCounts()
        self.tenants = TenantAccounts(settings.tenants, settings.max_tenants, settings.tenant_remember_blocks)
        # Context length (prompt + output) per model, an exponentially weighted mean over about
        # the last CONTEXT_WINDOW requests: the decode traffic estimate needs "now", not a lifetime.
        self._context = np.full(self._model_slots, np.nan)

    def add(self, validated: Validated, source: str) -> None:
        """Count one validated batch: its records, its rejections and its unknown fields."""
        batch = validated.batch
        reduced = None
        if len(batch):
            reduced = reduce(
                batch,
                edges=self._length_edges,
                cost_for=self.settings.cost_model_for,
                default_model=self.settings.default_model,
            )
            with self._lock:  # labels are admitted in arrival order
                lookup = np.fromiter(map(self._models.index_of, reduced.model_names), np.intp)
            slots = lookup[reduced.model_codes]
            overflow = int(np.count_nonzero(slots == self._models.other))
            sums = self._sum(batch, reduced, slots)
            context = self._context_means(batch, slots)
            # last before the sums' commit below, which cannot fail: nothing of a batch that
            # raised is counted (the sender's retry then counts it once)
            self.tenants.add(batch, reduced)
        rejected = validated.rejections.counts_by_reason()
        with self._lock:
            health = self._health
            health.received[source] += len(batch) + len(validated.rejections)
            health.unknown_fields[source] += validated.unknown_fields
            for reason, count in rejected.items():
                health.rejected[(source, reason)] += count
            if reduced is not None:
                health.series_overflow += overflow
                self._state += sums
                counts, means = context
                seen = counts > 0
                decay = (1.0 - 1.0 / CONTEXT_WINDOW) ** counts[seen]
                previous = np.where(np.isnan(self._context[seen]), means[seen], self._context[seen])
                self._context[seen] = previous * decay + means[seen] * (1.0 - decay)

    def _context_means(
        self, batch: RecordBatch, model_slots: npt.NDArray[np.intp]
    ) -> tuple[Int64Array, FloatArray]:
        context = batch.prompt_tokens + np.maximum(batch.output_tokens, 0)
        counts = np.bincount(model_slots, minlength=self._model_slots)
        sums = np.bincount(model_slots, weights=context, minlength=self._model_slots)
        return counts, np.divide(sums, counts, out=np.zeros(self._model_slots), where=counts > 0)

    def add_dropped(self, source: str, count: int) -> None:
        """Records a sender says it dropped before delivery."""
        with self._lock:
            self._health.dropped[source] += count

    def _sum(self, batch: RecordBatch, reduced: Reduced, model_slots: npt.NDArray[np.intp]) -> GroupState:
        """The batch's sums per group (label slot x prompt_len x cache)."""
        model_length = model_slots * len(self._length_labels) + reduced.length_group
        group = pack_hit(model_length, reduced.hit)
        groups = self._groups

        def by_group(weights: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
            return np.bincount(group, weights=weights, minlength=groups)

        # Work per unit in one pass: row = unit * groups + group.
        unit_group = reduced.unit.astype(np.intp) * groups + group
        units = len(UNITS)

        def by_unit(weights: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
            return np.bincount(unit_group, weights=weights, minlength=units * groups).reshape(units, groups)

        # All latency fields in one pass: row = field * groups + group.
        fields = len(LATENCY_FIELDS)
        rows = (np.arange(fields)[:, None] * groups + group[None, :]).ravel()
        values = np.concatenate([getattr(batch, name) for name in LATENCY_FIELDS])
        stacked = _histogram(rows, values, self._latency_edges, fields * groups)
        counts = stacked.counts.reshape(fields, groups, -1)
        sums = stacked.sums.reshape(fields, groups)
        latency = {name: Histograms(counts[i], sums[i]) for i, name in enumerate(LATENCY_FIELDS)}
        reuse = _histogram(
            model_length,
            definitions.request_reuse_fraction(reduced.prompt_tokens, reduced.cached_tokens),
            self._reuse_edges,
            prefixes_of(groups),
        )
        components, complete = reduced.ttft, reduced.ttft_complete
        slots_complete = model_slots[complete]
        ttft_components: FloatArray = np.stack(
            [
                np.bincount(slots_complete, weights=part[complete], minlength=self._model_slots)
                for part in (components.queue, components.prefill, components.other)
            ],
            axis=1,
        )
        overlap = np.bincount(
            slots_complete, weights=components.overlapped[complete], minlength=self._model_slots
        )
        return GroupState(
            requests=by_group().astype(np.int64, copy=False),
            prompt_tokens=by_group(reduced.prompt_tokens).astype(np.int64),
            cached_tokens=by_group(reduced.cached_tokens).astype(np.int64),
            prompt_work=by_unit(reduced.prompt_work),
            reused_work=by_unit(reduced.reused_work),
            work_requests=by_unit().astype(np.int64, copy=False),
            latency=latency,
            reuse=reuse,
            ttft_components=ttft_components,
            ttft_overlap=overlap.astype(np.int64),
        )

    def snapshot(self) -> Snapshot:
        with self._lock:
            health = self._health
            models = self._models
            unused = [""] * (models.capacity - len(models.names))
            sources = {*self.sources, *health.received}
            return Snapshot(
                model_labels=[*models.names, *unused, OTHER_MODEL],
                prompt_len_labels=list(self._length_labels),
                latency_buckets=list(self.settings.latency_buckets_seconds),
                reuse_buckets=list(self.settings.reuse_ratio_buckets),
                state=self._state.copy(),
                received={source: health.received[source] for source in sorted(sources)},
                rejected={
                    **{(source, reason): 0 for source in sorted(sources) for reason in REASONS},
                    **health.rejected,
                },
                dropped={source: health.dropped[source] for source in sorted(sources)},
                unknown_fields={source: health.unknown_fields[source] for source in sorted(sources)},
                series_overflow=health.series_overflow,
                declared_models=models.capacity if models.fixed else 0,
                declared_units=[self.settings.cost_model_for(name).unit for name in models.names]
                if models.fixed
                else [],
                context_tokens={
                    models.label(slot): float(self._context[slot])
                    for slot in np.flatnonzero(~np.isnan(self._context)).tolist()
                },
            )


def _histogram(
    rows: npt.NDArray[np.intp], values: FloatArray, edges: FloatArray, row_count: int
) -> Histograms:
    """Bucket ``values`` (NaN = absent, skipped) per row; a value equal to an edge falls in it (le)."""
    present = ~np.isnan(values)
    if not present.all():
        rows, values = rows[present], values[present]
    width = edges.size + 1
    bucket = np.searchsorted(edges, values, side="left")
    counts = np.bincount(rows * width + bucket, minlength=row_count * width).reshape(row_count, width)
    sums: FloatArray = np.bincount(rows, weights=values, minlength=row_count).astype(np.float64)
    return Histograms(counts.astype(np.int64, copy=False), sums)
