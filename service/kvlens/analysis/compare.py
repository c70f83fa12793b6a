"""``kvlens compare``: one fixed request sequence replayed under different cache settings.

The arms (for example ``off``, ``cold``, ``warm``) must hold the same requests in the same
order: same count, same prompt lengths position by position; otherwise the comparison is
refused, naming the first difference. The report's first table is the paired answer
(:mod:`kvlens.analysis.per_request`): requests matched by ``request_id``, per arm x prompt
length x the request's outcome in that arm, which waited less, by how much, and which did not
benefit. The first ``warmup`` requests (or those arriving before ``warmup_until``) are reported
apart and kept out of the timed window. Per prompt-length x cache group of the baseline arm,
each arm's percentiles (``--percentiles``) of TTFT, queue and prefill are compared with the
baseline's, with paired bootstrap 95 % intervals (the same resampled requests in both arms),
beside each arm's token reuse and modelled compute saved in that group: reuse is not
speedup, and the report puts the two side by side so that a reader does not take one for the other.

Two engines answer what :func:`build` asks (:class:`Paired`): ``numpy`` holds every arm in
memory (:class:`InMemory`); ``duckdb`` (the ``scale`` extra) reads the arms into DuckDB and
streams one group's values at a time (:mod:`kvlens.analysis.duckdb.compare`). A group of more
than :data:`MAX_GROUP_REQUESTS` timed requests is refused by both.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvlens import definitions, stats
from kvlens.accounting import Accounting
from kvlens.analysis import per_request, run_facts, sessions
from kvlens.analysis.report import Derived, cells_of, totals_of
from kvlens.definitions import Totals
from kvlens.errors import ArmsDiffer, GroupTooLarge, NoRecordsOfArm
from kvlens.records import RecordBatch

SCHEMA = "kvlens.compare/v1"
RESAMPLES = 1000
METRICS = ("ttft_seconds", "queue_seconds", "prefill_seconds")
# Timed requests of one group (prompt length x cache in the baseline) compared at most: the
# bootstrap resamples each group 1,000 times per arm, metric and quantile (at 5M requests, hours
# of CPU), and the duckdb engine holds one group's values of one metric of two arms in Python
# (16 bytes a request) beside the bootstrap's chunk (about 160 MB).
MAX_GROUP_REQUESTS = 5_000_000
FloatArray = npt.NDArray[np.float64]


def load_arm(
    name: str, path: str, settings: Accounting, *, format_name: str | None = None, model: str | None = None
) -> Arm:
    """Arm ``name`` from a records file: all of it, or its records of that arm when the file holds
    several (``kvlens simulate --emit-records``)."""
    from kvlens.analysis import reader

    batch = reader.read([path], format_name=format_name, model=model).batch
    if any(arm is not None for arm in batch.arm):
        batch = batch.select(np.array([arm == name for arm in batch.arm], dtype=bool))
        if not len(batch):
            raise NoRecordsOfArm(no_records_of(path, name))
    return _arm_of(name, batch, settings, path)


def _arm_of(name: str, batch: RecordBatch, settings: Accounting, path: str | None) -> Arm:
    derived = Derived.of(batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model)
    return Arm(name, derived, path)


def load_answered(
    specs: Sequence[tuple[str, str]],
    settings: Accounting,
    *,
    format_name: str | None = None,
    model: str | None = None,
) -> tuple[list[Arm], int]:
    """The arms without the requests recorded as failed in any of them, and how many those are.
    A failed request has no timing and no record the reader keeps, so an arm where one failed
    would hold one request fewer than the others and could not be paired: by ``request_id``
    (the trace index, the same in every arm), a request that failed anywhere is compared
    nowhere. Any other difference between the arms is still refused (:func:`compare`)."""
    arms = [load_arm(name, path, settings, format_name=format_name, model=model) for name, path in specs]
    failed = set().union(*(run_facts.failed_request_ids(path, name) for name, path in specs))
    if not failed:
        return arms, 0
    kept = []
    for arm in arms:
        batch = arm.derived.batch.select(np.array([i not in failed for i in arm.derived.batch.request_id]))
        kept.append(_arm_of(arm.name, batch, settings, arm.path))
    return kept, len(failed)


def no_records_of(path: str, name: str) -> str:
    return f"{path} has no records of arm {name!r}"


@dataclass(frozen=True)
class Arm:
    name: str
    derived: Derived
    path: str | None = None  # the records file, named in the report's context


# ---------------------------------------------------------------------------------------------
# What an engine answers (numpy here, SQL in kvlens.analysis.duckdb.compare); the report is
# built from these answers alone, by :func:`build`, so both engines share every step after them.


class Paired(Protocol):
    """Arms checked to replay one sequence, with the warm-up marked (:func:`warmup_mask`)."""

    def requests(self) -> int:
        """Requests of each arm."""
        ...

    def groups(self) -> list[tuple[int, bool, int]]:
        """(prompt-length group, hit in the baseline, timed requests) of each group that has
        timed requests, groups in ascending order, hits first."""
        ...

    def values(self, length: int, hit: bool, arm: int, metric: str) -> tuple[FloatArray, FloatArray]:
        """The baseline's and arm ``arm``'s ``metric`` (NaN where absent) over the group's timed
        requests, in request order."""
        ...

    def reuse(self, length: int, hit: bool) -> list[Totals]:
        """Each arm's totals over the group's timed requests."""
        ...

    def warmup(self) -> list[tuple[Totals, float | None]]:
        """Each arm's totals over the warm-up, and the median of its present TTFTs there."""
        ...

    def timed(self, arm: int) -> per_request.Timed:
        """Arm ``arm``'s timed requests (the warm-up left out), in request order."""
        ...

    def not_benefiting(self, arm: int) -> tuple[int, int, int, list[dict[str, Any]]]:
        """Of the timed requests with TTFT in both, those whose TTFT in arm ``arm`` is not below
        the baseline's, those compared, those of the first that reused nothing, and the first
        ten of them (:func:`example`)."""
        ...


def build(
    paired: Paired,
    names: list[str],
    files: list[str | None],
    labels: list[str],
    seed: int,
    percentiles: tuple[float, ...] = stats.DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The comparison's report. Groups come one at a time and each metric of each arm is
    fetched alone, so an engine that streams them holds one group's pair of columns."""
    rng = np.random.default_rng(seed)
    base = names[0]
    groups = []
    for length, hit, count in paired.groups():
        where = f"{labels[length]} tokens, {'hit' if hit else 'miss'} in {base}"
        if count > MAX_GROUP_REQUESTS:
            raise GroupTooLarge(
                f"the group {where} has {count:,} timed requests; compare takes at most "
                f"{MAX_GROUP_REQUESTS:,} a group (the bootstrap resamples each 1,000 times): split it "
                "with finer prompt_length_edges in --config, or compare a part of the replay"
            )
        deltas = {
            name: {
                metric: _deltas(*paired.values(length, hit, index, metric), rng, percentiles)
                for metric in METRICS
            }
            for index, name in enumerate(names[1:], start=1)
        }
        groups.append(
            {
                "prompt_len": labels[length],
                "cache_in_baseline": "hit" if hit else "miss",
                "requests": count,
                "arms": deltas,
                "reuse": {
                    name: {
                        "token_reuse_ratio": totals.token_reuse_ratio,
                        "compute_saved_ratio": totals.compute_saved_ratio,
                    }
                    for name, totals in zip(names, paired.reuse(length, hit), strict=True)
                },
            }
        )
    return {
        "schema": SCHEMA,
        "baseline": base,
        "arms": names,
        "requests": paired.requests(),
        "percentiles": list(percentiles),
        "paired": per_request.compare(
            names, [paired.timed(index) for index in range(len(names))], labels, percentiles
        ),
        "files": dict(zip(names, files, strict=True)),
        "warmup": {
            name: {
                "requests": totals.requests,
                "token_reuse_ratio": totals.token_reuse_ratio,
                "ttft_p50": p50,
            }
            for name, (totals, p50) in zip(names, paired.warmup(), strict=True)
        },
        "groups": groups,
        "not_benefiting": {
            name: _not_benefiting(*paired.not_benefiting(index))
            for index, name in enumerate(names[1:], start=1)
        },
    }


def median_of(count: int, pick: Callable[[list[int]], list[float]]) -> float | None:
    """The median of ``count`` values whose order statistics ``pick`` returns (any engine's),
    as ``np.percentile`` gives it."""
    return definitions.quantiles(count, (0.5,), pick)[0] if count else None


def example(
    position: int, request_id: str | None, prompt: int, cached: int, before: float, after: float
) -> dict[str, Any]:
    """A request that did not benefit; ``position`` counts from 0."""
    return {
        "request": position + 1,
        "request_id": request_id,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_baseline": before,
        "ttft_arm": after,
    }


def _not_benefiting(
    worse: int, comparable: int, reused_nothing: int, examples: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "requests": worse,
        "share": worse / comparable if comparable else None,
        "of_which_reused_nothing": reused_nothing,
        "examples": examples,
    }


def _deltas(
    before: FloatArray, after: FloatArray, rng: np.random.Generator, percentiles: tuple[float, ...]
) -> dict[str, Any]:
    """Each percentile's baseline -> arm and its paired bootstrap interval; the median always
    (the verdict and the charts read it)."""
    present = ~(np.isnan(before) | np.isnan(after))
    if not present.any():
        return {"count": 0}
    before, after = before[present], after[present]
    out: dict[str, Any] = {"count": int(before.size)}
    for q in sorted({50.0, *percentiles}):
        low, high = float(np.percentile(before, q)), float(np.percentile(after, q))
        out[f"p{stats.percentile_name(q)}"] = {
            "baseline": low,
            "arm": high,
            "delta": float(np.percentile(after, q) - np.percentile(before, q)),
            "ci95": _bootstrap(before, after, q, rng) if before.size > 1 else None,
        }
    return out


def _bootstrap(before: FloatArray, after: FloatArray, q: float, rng: np.random.Generator) -> list[float]:
    """95 % interval of the paired difference of the q-th percentiles (the same resampled
    requests in both arms), resampled in chunks to bound memory."""
    size = before.size
    per_chunk = max(1, 4_000_000 // size)
    deltas = []
    for start in range(0, RESAMPLES, per_chunk):
        picks = rng.integers(0, size, size=(min(per_chunk, RESAMPLES - start), size))
        deltas.append(np.percentile(after[picks], q, axis=1) - np.percentile(before[picks], q, axis=1))
    return [float(v) for v in np.percentile(np.concatenate(deltas), [2.5, 97.5])]


# ---------------------------------------------------------------------------------------------
# The numpy engine: every arm in memory.


def check_same_sequence(arms: Sequence[Arm]) -> None:
    base = arms[0]
    for arm in arms[1:]:
        a, b = base.derived.batch, arm.derived.batch
        if len(a) != len(b):
            raise ArmsDiffer(count_differs(arm.name, len(b), base.name, len(a)))
        different = np.flatnonzero(a.prompt_tokens != b.prompt_tokens)
        if different.size:
            i = int(different[0])
            raise ArmsDiffer(
                prompt_differs(arm.name, base.name, i, int(b.prompt_tokens[i]), int(a.prompt_tokens[i]))
            )
        for left, right in zip(a.request_id, b.request_id, strict=True):
            if left is not None and right is not None and left != right:
                raise ArmsDiffer(id_differs(arm.name, base.name, right, left))


def count_differs(arm: str, count: int, base: str, base_count: int) -> str:
    return f"arm {arm} has {count} requests, {base} has {base_count}"


def prompt_differs(arm: str, base: str, position: int, prompt: int, base_prompt: int) -> str:
    return (
        f"arm {arm} differs from {base} at request {position + 1}: prompt_tokens "
        f"{prompt} vs {base_prompt} (the arms must replay the same requests in the same order)"
    )


def id_differs(arm: str, base: str, request_id: str, base_id: str) -> str:
    return f"arm {arm} differs from {base}: request_id {request_id!r} vs {base_id!r}"


def warmup_mask(batch: RecordBatch, warmup: int, warmup_until: float | None) -> npt.NDArray[np.bool_]:
    mask = np.zeros(len(batch), bool)
    mask[:warmup] = True
    if warmup_until is not None:
        mask |= batch.arrival_time < warmup_until
    return mask


def compare(
    arms: list[Arm],
    *,
    warmup: int = 0,
    warmup_until: float | None = None,
    seed: int = 0,
    percentiles: tuple[float, ...] = stats.DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    check_same_sequence(arms)
    warm = warmup_mask(arms[0].derived.batch, warmup, warmup_until)
    for arm in arms[1:]:
        warm |= warmup_mask(arm.derived.batch, warmup, warmup_until)
    paired = InMemory(arms, warm)
    result = build(
        paired,
        [arm.name for arm in arms],
        [arm.path for arm in arms],
        arms[0].derived.length_labels,
        seed,
        percentiles,
    )
    by_arm = {arm.name: sessions.session_report(arm.derived.batch.select(~warm)) for arm in arms}
    if any(by_arm.values()):
        result["sessions"] = by_arm  # the measured requests' (the warm-up's apart)
    return result


class InMemory:
    """:class:`Paired` of arms held in memory."""

    def __init__(self, arms: Sequence[Arm], warm: npt.NDArray[np.bool_]) -> None:
        self.arms, self.warm = arms, warm
        self.rows: dict[tuple[int, bool], npt.NDArray[np.bool_]] = {}

    def requests(self) -> int:
        return len(self.arms[0].derived.batch)

    def groups(self) -> list[tuple[int, bool, int]]:
        base = self.arms[0].derived
        out = []
        for length in range(len(base.length_labels)):
            for hit in (True, False):
                rows = ~self.warm & (base.length_group == length) & (base.hit == hit)
                if rows.any():
                    self.rows[(length, hit)] = rows
                    out.append((length, hit, int(rows.sum())))
        return out

    def values(self, length: int, hit: bool, arm: int, metric: str) -> tuple[FloatArray, FloatArray]:
        rows = self.rows[(length, hit)]
        return (
            getattr(self.arms[0].derived.batch, metric)[rows],
            getattr(self.arms[arm].derived.batch, metric)[rows],
        )

    def reuse(self, length: int, hit: bool) -> list[Totals]:
        rows = self.rows[(length, hit)]
        return [totals_of(cells_of(arm.derived, rows), arm.derived.cost_for) for arm in self.arms]

    def warmup(self) -> list[tuple[Totals, float | None]]:
        out = []
        for arm in self.arms:
            ttft = arm.derived.batch.ttft_seconds[self.warm]
            present = ttft[~np.isnan(ttft)]
            median = median_of(present.size, functools.partial(stats.order_statistics, present))
            out.append((totals_of(cells_of(arm.derived, self.warm), arm.derived.cost_for), median))
        return out

    def timed(self, arm: int) -> per_request.Timed:
        derived, rows = self.arms[arm].derived, ~self.warm
        batch = derived.batch
        return per_request.Timed(
            list(itertools.compress(batch.request_id, rows.tolist())),
            derived.length_group[rows],
            batch.prompt_tokens[rows],
            batch.cached_tokens[rows],
            batch.ttft_seconds[rows],
        )

    def not_benefiting(self, arm: int) -> tuple[int, int, int, list[dict[str, Any]]]:
        base, batch = self.arms[0].derived.batch, self.arms[arm].derived.batch
        before, after = base.ttft_seconds, batch.ttft_seconds
        comparable = ~self.warm & ~(np.isnan(before) | np.isnan(after))
        worse = comparable & (after >= before)
        reused = batch.cached_tokens > 0
        examples = [
            example(
                int(i),
                batch.request_id[i],
                int(batch.prompt_tokens[i]),
                int(batch.cached_tokens[i]),
                float(before[i]),
                float(after[i]),
            )
            for i in np.flatnonzero(worse)[:10]
        ]
        return int(worse.sum()), int(comparable.sum()), int((worse & ~reused).sum()), examples
