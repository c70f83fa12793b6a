"""Exact order statistics in bounded memory, for the ``duckdb`` engine.

An engine's sort or its ``quantile`` aggregate either holds a group's values in memory or sorts
all of them; instead each wanted rank is found by narrowing a value range with histograms
(about :data:`BIN_VALUES` values a bin) until the range holds one distinct value or few enough
values to sort. The histograms are counted in numpy over chunks of the records
(:data:`CHUNK_ROWS`, ranges of row numbers that the scans prune to), not by the engine's hash
aggregate (several times dearer per value); a sample read first predicts the bins holding the
ranks, whose values the first pass keeps, so one read of the records usually suffices
(:func:`at_ranks`). Records that fit in one chunk are read once and each part ranked by
``np.partition``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens.analysis import report
from kvlens.analysis.duckdb.engine import Engine
from kvlens.reduce import pack_hit

BINS = 1 << 18  # histogram bins of a part a pass, at most (a part past 268M values gets fuller bins)
BIN_VALUES = 1024  # values a bin is sized for: a pass leaves ranges of about that many to fetch
FETCH_MAX = 16384  # values in range fetched to pick the rank directly

Part = tuple[str, int, bool]  # (series, length group or -1 for all records, hit)


SERIES = (*report.LATENCY_COLUMNS, "prefill_per_computed_token", "all_ttft")
_PART_STRIDE = 1 << 20  # parts are keyed by one integer: series * stride + pack_hit(group + 1, hit)


def part_key(part: Part) -> int:
    return SERIES.index(part[0]) * _PART_STRIDE + pack_hit(part[1] + 1, int(part[2]))


CHUNK_ROWS = 1 << 20  # records up to this many are read into numpy once, whole, and partitioned
# Past CHUNK_ROWS, records read into numpy at once: a read holds about 400 bytes a record (each
# of 7 values with its position, bin and group, twice while the parts are joined), so 1M rows
# held 0.5 GB beside DuckDB's memory at 10M records (the peak RSS goal is 1 GiB), these 50 MB.
READ_ROWS = 1 << 17


@dataclass(frozen=True)
class Series:
    """Values to rank, read a chunk at a time: ``sql(where)`` selects, of the rows matching
    ``where`` (one of ``chunks``, which together cover every row once), an integer column ``g``
    and value columns ``v0, v1, ...``. Value ``i`` of a row belongs to the part keyed
    ``keys[i] + g`` when ``grouped[i]``, else ``keys[i]`` (:func:`part_key`). NULLs are not
    ranked."""

    sql: Callable[[str], str]
    keys: tuple[int, ...]
    grouped: tuple[bool, ...]
    chunks: tuple[str, ...] = ("TRUE",)
    columns: tuple[int, ...] | None = None  # the value column each key reads (default: v0, v1, ...)
    sample: tuple[str, ...] | None = None  # rows read first to predict where the ranks lie (:func:`_predict`)


def row_chunks(records: int, last_row: int) -> tuple[str, ...]:
    """Predicates on ``row`` (a record's line or row in its file) that split ``records`` past
    :data:`CHUNK_ROWS` into reads of about :data:`READ_ROWS`: ranges of row numbers (of every
    file at once), which DuckDB prunes to the Parquet row groups and table row groups that
    hold them."""
    if records <= CHUNK_ROWS:
        return ("TRUE",)
    count = -(-records // min(READ_ROWS, CHUNK_ROWS))
    width = -(-(last_row + 1) // count)
    return tuple(f"row >= {start} AND row < {start + width}" for start in range(0, last_row + 1, width))


SAMPLE_BLOCKS = 16  # the sample is this many blocks of rows spread over the row numbers


def sample_rows(records: int, last_row: int) -> tuple[str, ...] | None:
    """Predicates on ``row`` picking about :data:`CHUNK_ROWS` records in
    :data:`SAMPLE_BLOCKS` blocks spread over the row numbers (pruned to their row groups like a
    chunk), read a few blocks at a time (about :data:`READ_ROWS` records each), or None when
    the records are one chunk (read once anyway)."""
    if records <= CHUNK_ROWS:
        return None
    block = max(1, CHUNK_ROWS * (last_row + 1) // records // SAMPLE_BLOCKS)
    step = (last_row + 1) // SAMPLE_BLOCKS
    blocks = [f"(row >= {index * step} AND row < {index * step + block})" for index in range(SAMPLE_BLOCKS)]
    per_read = max(1, SAMPLE_BLOCKS * min(READ_ROWS, CHUNK_ROWS) // CHUNK_ROWS)
    return tuple(" OR ".join(blocks[at : at + per_read]) for at in range(0, SAMPLE_BLOCKS, per_read))


@dataclass
class _Target:
    part: Part
    rank: int
    low: float  # the values of the target's window lie in [low, high] (infinite: not known yet)
    high: float
    offset: int  # rank within the window
    count: int  # values within the window
    first_bin: int = -1  # the bin of the first pass that holds it (-1: before the first pass)
    value: float | None = None


def _root(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``values ** (1/16)`` by four square roots: nearly a logarithm over the few decades
    latencies span, and monotone (IEEE square roots are correctly rounded), defined at 0."""
    return np.sqrt(np.sqrt(np.sqrt(np.sqrt(values))))


ROOT_BELOW = 0.25  # a part whose mean lies in the lowest quarter of [min, max] is binned on the root scale


@dataclass(frozen=True)
class _Scale:
    """How the first pass bins a part: ``[lo, hi]`` in the scale's units, ``nb`` bins."""

    lo: float
    hi: float
    nb: int
    root: bool


def _scales(bounds: dict[Part, tuple[int, float, float]], means: dict[Part, float]) -> dict[Part, _Scale]:
    """Each part's first-pass scale: the root scale when its mean is low in its range (a long
    tail: linear bins would hold nearly all values in the first few; the mean only chooses the
    bins, never a value), its values are not negative and the root separates min and max."""
    out = {}
    for part, (count, low, high) in bounds.items():
        nb = _bins_for(count)
        mean = means.get(part)
        if mean is not None and high > low >= 0 and (mean - low) / (high - low) < ROOT_BELOW:
            root_low, root_high = (float(_root(np.float64(x))) for x in (low, high))
            if root_high > root_low:
                out[part] = _Scale(root_low, root_high, nb, True)
                continue
        out[part] = _Scale(low, high, nb, False)
    return out


def _bins_for(count: int) -> int:
    """Bins for ``count`` values: about :data:`BIN_VALUES` a bin (an even spread is left to
    fetch after one pass)."""
    return max(2, min(BINS, -(-count // BIN_VALUES)))


class _Layout:
    """The first pass's bins of every part laid end to end: a value's bin is one index into
    one array of counts. Its position ``(x - lo) / (hi - lo) * nb`` (``x`` the value or its
    :func:`_root`) is monotone in the value, and so is the bin (its floor, clipped), so each bin
    holds a run of the part's sorted values; every pass computes it by the same numpy code."""

    def __init__(self, parts: list[Part], scales: dict[Part, _Scale]) -> None:
        self.parts = parts
        self.index = {part_key(part): i for i, part in enumerate(parts)}
        self.lo = np.array([scales[p].lo for p in parts], dtype=np.float64)
        self.span = np.array(
            [scales[p].hi - scales[p].lo for p in parts], dtype=np.float64
        )  # > 0, maybe subnormal
        self.nb = np.array([scales[p].nb for p in parts], dtype=np.int64)
        self.root = np.array([scales[p].root for p in parts], dtype=np.bool_)
        self.offset = np.concatenate(([0], np.cumsum(self.nb)))
        self.total = int(self.offset[-1])

    def place(
        self, values: npt.NDArray[np.float64], part: int
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """The positions of one part's values and the layout indexes of their bins."""
        x = _root(values) if self.root[part] else values
        position = (x - self.lo[part]) / self.span[part] * self.nb[part]
        floor = np.floor(position)
        np.clip(floor, 0, self.nb[part] - 1, out=floor)
        bins = floor.astype(np.int64)
        bins += self.offset[part]
        return position, bins


def _split(
    got: dict[str, Any], series: Series, index: dict[int, int]
) -> Iterator[tuple[int, npt.NDArray[np.float64], npt.NDArray[np.int32]]]:
    """The values of one read of ``series`` (``got``) of each part in ``index`` (part key:
    position), with the ``g`` of each value's row. The rows are sorted by ``g`` once, so each
    part is a slice of every column."""
    columns = series.columns or tuple(range(len(series.keys)))
    g = np.asarray(got["g"], dtype=np.int64)
    small = g.size and g.min() >= -(1 << 15) and g.max() < 1 << 15
    order = np.argsort(g.astype(np.int16) if small else g, kind="stable")  # int16: a radix sort
    g = g[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(g)) + 1, [g.size]))
    rows_g = g.astype(np.int32)  # each value's g, carried along: 4 bytes a value
    slices = [
        (int(g[start]), int(start), int(end)) for start, end in itertools.pairwise(starts) if end > start
    ]
    for column_index in sorted(set(columns)):
        column = got[f"v{column_index}"]
        values = np.asarray(column, dtype=np.float64)[order]
        mask = getattr(column, "mask", None)  # a masked array where the column has NULLs
        present = None if mask is None or not np.any(mask) else ~np.asarray(mask)[order]
        for key, grouped in (
            (k, gr)
            for c, k, gr in zip(columns, series.keys, series.grouped, strict=True)
            if c == column_index
        ):
            for value_of_g, start, end in slices if grouped else [(0, 0, g.size)]:
                part = index.get(key + value_of_g if grouped else key)
                if part is None:
                    continue
                chosen, of_g = values[start:end], rows_g[start:end]
                if present is not None:
                    chosen, of_g = chosen[present[start:end]], of_g[present[start:end]]
                if chosen.size:
                    yield part, chosen, of_g


def _read(engine: Engine, series: Series, layout: _Layout, wheres: Sequence[str] = ()) -> Iterator[Placed]:
    """Per chunk (``wheres``, default: every chunk): the values of parts that have a target,
    their positions and the layout indexes of their bins, each part placed with its own
    constants (not a lookup of them for every value)."""
    for where in wheres or series.chunks:
        got = engine.connection.execute(series.sql(where)).fetchnumpy()
        pieces = [
            (chosen, *layout.place(chosen, part), of_g)
            for part, chosen, of_g in _split(got, series, layout.index)
        ]
        if not pieces:
            continue
        placed = (
            np.concatenate([piece[0] for piece in pieces]),
            np.concatenate([piece[1] for piece in pieces]),
            np.concatenate([piece[2] for piece in pieces]),
            np.concatenate([piece[3] for piece in pieces]),
        )
        del pieces, got  # the caller holds this chunk while the next is fetched: not its pieces too
        yield placed


def _ranked_whole(
    engine: Engine, series: Series, parts: list[Part], targets: list[_Target], tail: Tail | None
) -> None:
    """``series`` in one chunk: every value is in memory at once, so each part's ranks are
    picked by ``np.partition`` in one read (the value at a rank is the same by any method), with
    no bins and no second pass. ``tail``: its part's values and their ``g`` are kept for
    :meth:`Tail.at_least`."""
    index = {part_key(part): position for position, part in enumerate(parts)}
    got = engine.connection.execute(series.sql(series.chunks[0])).fetchnumpy()
    values: dict[int, list[npt.NDArray[np.float64]]] = {}
    groups: dict[int, list[npt.NDArray[np.int32]]] = {}
    for at, chosen, of_g in _split(got, series, index):
        values.setdefault(at, []).append(chosen)
        groups.setdefault(at, []).append(of_g)
    whole = {at: np.concatenate(pieces) for at, pieces in values.items()}
    for position, part in enumerate(parts):
        own = [target for target in targets if target.part == part]
        ordered = np.partition(whole[position], sorted({target.rank for target in own}))
        for target in own:
            target.value = float(ordered[target.rank])
    if tail is not None and (kept := index.get(part_key(tail.part))) is not None:
        tail.whole = (whole[kept], np.concatenate(groups[kept]))


Placed = tuple[
    npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int32]
]  # values, positions, bins, and the g of each value's row


def at_ranks(
    engine: Engine,
    series: Series,
    wanted: dict[Part, list[int]],
    bounds: dict[Part, tuple[int, float, float]],
    means: dict[Part, float] | None = None,
    tail: Tail | None = None,
) -> dict[tuple[Part, int], float]:
    """The values at ``wanted`` ranks (0-based, ascending) of each part of ``series``;
    ``bounds`` gives each part's count, min and max; ``means`` (optional) each part's mean,
    which picks the first pass's bin scale (:func:`_scales`).

    The values are read into numpy a chunk at a time (an engine's hash aggregate over every
    value cost several times more). The first pass counts every part's values in bins (about
    :data:`BIN_VALUES` each) and keeps, for each target, the bin holding its rank. Each later
    pass reads the values again and keeps only those in the targets' windows: a window of at
    most :data:`FETCH_MAX` values is kept whole and sorted; a larger one (ties, a crowded bin)
    is counted in finer bins and shrinks to the one holding the rank, with its min and max.
    ``tail``: the first pass also counts that part's values by bin and ``g`` (:class:`Tail`).
    Records that are one chunk are read once and ranked whole (:func:`_ranked_whole`)."""
    targets = [
        _Target(part, rank, bounds[part][1], bounds[part][2], rank, bounds[part][0])
        for part, ranks in wanted.items()
        for rank in ranks
    ]
    for target in targets:
        if target.low == target.high:
            target.value = target.low
    open_targets = [t for t in targets if t.value is None]
    if open_targets and len(series.chunks) == 1:
        _ranked_whole(
            engine, series, sorted({t.part for t in open_targets}, key=part_key), open_targets, tail
        )
    elif open_targets:
        parts = sorted({t.part for t in open_targets}, key=part_key)
        layout = _Layout(parts, _scales({part: bounds[part] for part in parts}, means or {}))

        def reads() -> Iterator[Placed]:
            return _read(engine, series, layout)

        predicted = None
        if series.sample is not None:
            sampled = np.zeros(layout.total, dtype=np.int64)
            for _, _, bins, _ in _read(engine, series, layout, series.sample):
                sampled += np.bincount(bins, minlength=layout.total)
            predicted = _predict(layout, open_targets, sampled, bounds)
        by_row = None if tail is None else layout.index.get(part_key(tail.part))
        stored = _first_pass(layout, open_targets, reads(), predicted, tail if by_row is not None else None)
        if stored is not None and all(predicted[t.first_bin] for t in open_targets):  # type: ignore[index]
            reads = lambda: iter(stored)  # noqa: E731  (every window's values are in memory)
        while open_targets := [t for t in targets if t.value is None]:
            _next_pass(layout, open_targets, reads())
    return {(t.part, t.rank): float(t.value) for t in targets if t.value is not None}


@dataclass
class Tail:
    """One part's values counted by ``g`` (the row's group key) and first-pass bin, with the
    values the first pass kept: how many of each ``g`` lie at or above a value found later
    (:meth:`at_least`) without another read of the records."""

    part: Part
    layout: _Layout | None = None
    predicted: npt.NDArray[np.bool_] | None = None
    stored: list[Placed] | None = None
    counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    bins: int = 0
    whole: tuple[npt.NDArray[np.float64], npt.NDArray[np.int32]] | None = (
        None  # every value and g (one chunk)
    )

    def count(self, groups: npt.NDArray[np.int32], bins: npt.NDArray[np.int64], nb: int) -> None:
        self.bins = nb
        got = np.bincount(groups * nb + bins, minlength=(int(groups.max(initial=0)) + 1) * nb)
        if got.size > self.counts.size:
            got[: self.counts.size] += self.counts
            self.counts = got
        else:
            self.counts[: got.size] += got

    def at_least(self, threshold: float) -> dict[int, int] | None:
        """Values >= ``threshold`` by ``g`` (none: left out), or None when the first pass did not
        keep the values of the bin holding it (a single chunk, too many values, a prediction
        missed): every bin above it is counted, and its own values compared one by one."""
        if self.whole is not None:
            values, groups = self.whole
            return {
                g: int(count) for g, count in enumerate(np.bincount(groups[values >= threshold])) if count
            }
        if self.layout is None or self.stored is None or self.predicted is None or not self.bins:
            return None
        part = self.layout.index[part_key(self.part)]
        (bin_,) = self.layout.place(np.array([threshold], dtype=np.float64), part)[1]
        if not self.predicted[bin_]:
            return None
        local = int(bin_ - self.layout.offset[part])
        above = [self.counts.reshape(-1, self.bins)[:, local + 1 :].sum(axis=1)]
        for values, _, bins, groups in self.stored:
            above.append(np.bincount(groups[(bins == bin_) & (values >= threshold)]))
        size = max(len(counts) for counts in above)
        by_g = np.sum([np.pad(counts, (0, size - len(counts))) for counts in above], axis=0)
        return {g: int(count) for g, count in enumerate(by_g) if count}


STORE_MAX = 1 << 23  # values the first pass keeps in the predicted bins (24 bytes each: ~200 MB)
SAMPLE_SIGMAS = 5.0  # the predicted bins span this many standard errors of the sample's quantile
WHOLE_PART = 1 << 16  # a part of at most this many values is kept whole (its sample is too thin)


def _predict(
    layout: _Layout,
    targets: list[_Target],
    sampled: npt.NDArray[np.int64],
    bounds: dict[Part, tuple[int, float, float]],
) -> npt.NDArray[np.bool_]:
    """The first-pass bins likely to hold the targets' ranks, from a sample's histogram: the
    bins between the sample's quantiles at the rank's fraction plus and minus
    :data:`SAMPLE_SIGMAS` standard errors (whole small parts). Only the cost depends on it: a
    rank outside costs the pass it would have cost anyway."""
    predicted = np.zeros(layout.total, dtype=np.bool_)
    for target in targets:
        part = layout.parts.index(target.part)
        start, end = int(layout.offset[part]), int(layout.offset[part + 1])
        count = bounds[target.part][0]
        own = np.cumsum(sampled[start:end])
        size = int(own[-1])
        if count <= WHOLE_PART:
            predicted[start:end] = True
            continue
        if size < 100:
            continue  # too thin a sample: this target will need a second read
        fraction = (target.rank + 0.5) / count
        margin = SAMPLE_SIGMAS * np.sqrt(fraction * (1 - fraction) / size) + 2 / size
        low = int(np.searchsorted(own, (fraction - margin) * size, side="left"))
        high = int(np.searchsorted(own, (fraction + margin) * size, side="left"))
        predicted[start + low : start + min(high, end - start - 1) + 1] = True
    return predicted


def _first_pass(
    layout: _Layout,
    targets: list[_Target],
    reads: Iterator[Placed],
    predicted: npt.NDArray[np.bool_] | None,
    tail: Tail | None = None,
) -> list[Placed] | None:
    """Counts every value in its bin and sets each target's bin; keeps the values of the
    ``predicted`` bins (None past :data:`STORE_MAX`: they are read again). ``tail``: counts
    its part's values by ``g`` and bin too."""
    counts = np.zeros(layout.total, dtype=np.int64)
    stored: list[Placed] | None = None if predicted is None else []
    size = 0
    if tail is not None:
        tail.layout, tail.predicted = layout, predicted
        part = layout.index[part_key(tail.part)]
        start, end = int(layout.offset[part]), int(layout.offset[part + 1])
    for values, position, bins, groups in reads:
        counts += np.bincount(bins, minlength=layout.total)
        if tail is not None:
            inside = (bins >= start) & (bins < end)
            tail.count(groups[inside], bins[inside] - start, end - start)
        if stored is not None and predicted is not None:
            chosen = predicted[bins]
            size += int(np.count_nonzero(chosen))
            if size > STORE_MAX:
                stored = None
            else:
                stored.append((values[chosen], position[chosen], bins[chosen], groups[chosen]))
    for target in targets:
        part = layout.parts.index(target.part)
        own = counts[layout.offset[part] : layout.offset[part + 1]]
        before = np.cumsum(own)
        found = int(np.searchsorted(before, target.offset, side="right"))
        target.first_bin = int(layout.offset[part]) + found
        target.count = int(own[found])
        target.offset -= int(before[found]) - target.count
        target.low, target.high = -np.inf, np.inf
    if tail is not None:
        tail.stored = stored
    return stored


@dataclass
class _Window:
    """Values of one layout bin within [low, high]: kept whole, or counted in ``nb`` finer bins
    (linear between ``low`` and ``high`` when both are known, else in the bin's own position)."""

    first_bin: int
    low: float
    high: float
    base: int = 0  # the layout offset of the bin's part (the bin within its part: first_bin - base)
    nb: int = 0  # 0: keep the values
    kept: list[npt.NDArray[np.float64]] = field(default_factory=list)
    counts: npt.NDArray[np.int64] | None = None
    mins: npt.NDArray[np.float64] | None = None
    maxs: npt.NDArray[np.float64] | None = None

    def take(self, values: npt.NDArray[np.float64], position: npt.NDArray[np.float64]) -> None:
        if not self.nb:
            self.kept.append(values)
            return
        if np.isfinite(self.low):
            fine = (values - self.low) / (self.high - self.low) * self.nb
        else:
            fine = (position - (self.first_bin - self.base)) * self.nb
        sub = np.clip(np.floor(fine), 0, self.nb - 1).astype(np.int64)
        assert self.counts is not None and self.mins is not None and self.maxs is not None
        self.counts += np.bincount(sub, minlength=self.nb)
        np.minimum.at(self.mins, sub, values)
        np.maximum.at(self.maxs, sub, values)


def _next_pass(layout: _Layout, targets: list[_Target], reads: Iterator[Placed]) -> None:
    windows: dict[tuple[int, float, float], _Window] = {}
    for target in targets:
        key = (target.first_bin, target.low, target.high)
        if key not in windows:
            part = layout.parts.index(target.part)
            window = windows[key] = _Window(
                target.first_bin, target.low, target.high, base=int(layout.offset[part])
            )
            if target.count > FETCH_MAX:
                window.nb = _bins_for(target.count)
                window.counts = np.zeros(window.nb, dtype=np.int64)
                window.mins = np.full(window.nb, np.inf)
                window.maxs = np.full(window.nb, -np.inf)
    by_bin: dict[int, list[_Window]] = {}
    for window in windows.values():
        by_bin.setdefault(window.first_bin, []).append(window)
    marked = np.zeros(layout.total, dtype=np.bool_)
    marked[list(by_bin)] = True
    for values, position, bins, _ in reads:
        chosen = marked[bins]
        if not chosen.any():
            continue
        bins, position, values = bins[chosen], position[chosen], values[chosen]
        for first_bin, group in by_bin.items():
            inside = bins == first_bin
            if not inside.any():
                continue
            for window in group:
                keep = inside & (values >= window.low) & (values <= window.high)
                window.take(values[keep], position[keep])
    for target in targets:
        window = windows[(target.first_bin, target.low, target.high)]
        if not window.nb:
            ordered = np.sort(np.concatenate(window.kept))
            target.value = float(ordered[target.offset])
            continue
        assert window.counts is not None and window.mins is not None and window.maxs is not None
        before = np.cumsum(window.counts)
        found = int(np.searchsorted(before, target.offset, side="right"))
        target.count = int(window.counts[found])
        target.offset -= int(before[found]) - target.count
        target.low, target.high = float(window.mins[found]), float(window.maxs[found])
        if target.low == target.high:
            target.value = target.low
