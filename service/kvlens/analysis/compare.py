"""``kvlens compare``: one fixed request sequence replayed under different cache settings.

The arms (for example ``off``, ``cold``, ``warm``) must hold the same requests in the same
order: same count, same prompt lengths position by position; otherwise the comparison is
refused, naming the first difference. The first ``warmup`` requests (or those arriving before
``warmup_until``) are reported apart and kept out of the timed window. Per prompt-length x
cache group of the baseline arm, each arm's p50 and p95 of TTFT, queue and prefill are compared
with the baseline's, with paired bootstrap 95 % intervals (the same resampled requests in both
arms), beside each arm's token reuse and modelled compute saved in that group: reuse is not
speedup, and the report puts the two side by side so that a reader does not take one for the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvlens.analysis.render import _md_table, _pct
from kvlens.analysis.report import Derived
from kvlens.config import Settings
from kvlens.records import RecordBatch

SCHEMA = "kvlens.compare/v1"
RESAMPLES = 1000
QUANTILES = (50, 95)
METRICS = ("ttft_seconds", "queue_seconds", "prefill_seconds")
REUSE_IS_NOT_SPEEDUP = (
    "Reuse is not speedup: cached tokens save prefill work, and TTFT falls only where prefill, "
    "not queueing, was the wait."
)


class ArmsDiffer(ValueError):
    """The arms do not replay the same request sequence."""


class NoRecordsOfArm(ValueError):
    """A file of several arms holds none of the arm asked for."""


def load_arm(
    name: str, path: str, settings: Settings, *, format_name: str | None = None, model: str | None = None
) -> Arm:
    """Arm ``name`` from a records file: all of it, or its records of that arm when the file holds
    several (``kvlens simulate --emit-records``)."""
    from kvlens.analysis import reader

    batch = reader.read([path], format_name=format_name, model=model).batch
    if any(arm is not None for arm in batch.arm):
        batch = batch.select(np.array([arm == name for arm in batch.arm], dtype=bool))
        if not len(batch):
            raise NoRecordsOfArm(f"{path} has no records of arm {name!r}")
    derived = Derived.of(batch, settings.prompt_length_edges, settings.cost_model_for, settings.default_model)
    return Arm(name, derived, path)


@dataclass(frozen=True)
class Arm:
    name: str
    derived: Derived
    path: str | None = None  # the records file, named in the report's context


def check_same_sequence(arms: list[Arm]) -> None:
    base = arms[0]
    for arm in arms[1:]:
        a, b = base.derived.batch, arm.derived.batch
        if len(a) != len(b):
            raise ArmsDiffer(f"arm {arm.name} has {len(b)} requests, {base.name} has {len(a)}")
        different = np.flatnonzero(a.prompt_tokens != b.prompt_tokens)
        if different.size:
            i = int(different[0])
            raise ArmsDiffer(
                f"arm {arm.name} differs from {base.name} at request {i + 1}: prompt_tokens "
                f"{int(b.prompt_tokens[i])} vs {int(a.prompt_tokens[i])} "
                "(the arms must replay the same requests in the same order)"
            )
        for left, right in zip(a.request_id, b.request_id, strict=True):
            if left is not None and right is not None and left != right:
                raise ArmsDiffer(f"arm {arm.name} differs from {base.name}: request_id {right!r} vs {left!r}")


def warmup_mask(batch: RecordBatch, warmup: int, warmup_until: float | None) -> npt.NDArray[np.bool_]:
    mask = np.zeros(len(batch), bool)
    mask[:warmup] = True
    if warmup_until is not None:
        mask |= batch.arrival_time < warmup_until
    return mask


def compare(
    arms: list[Arm], *, warmup: int = 0, warmup_until: float | None = None, seed: int = 0
) -> dict[str, Any]:
    check_same_sequence(arms)
    base = arms[0]
    warm = warmup_mask(base.derived.batch, warmup, warmup_until)
    for arm in arms[1:]:
        warm |= warmup_mask(arm.derived.batch, warmup, warmup_until)
    timed = ~warm
    rng = np.random.default_rng(seed)
    groups = []
    for length, label in enumerate(base.derived.length_labels):
        for cache, hit in (("hit", True), ("miss", False)):
            rows = np.flatnonzero(timed & (base.derived.length_group == length) & (base.derived.hit == hit))
            if rows.size == 0:
                continue
            groups.append(
                {
                    "prompt_len": label,
                    "cache_in_baseline": cache,
                    "requests": int(rows.size),
                    "arms": {
                        arm.name: {metric: _deltas(base, arm, metric, rows, rng) for metric in METRICS}
                        for arm in arms[1:]
                    },
                    "reuse": {arm.name: _reuse(arm, rows) for arm in arms},
                }
            )
    return {
        "schema": SCHEMA,
        "baseline": base.name,
        "arms": [arm.name for arm in arms],
        "requests": len(base.derived.batch),
        "files": {arm.name: arm.path for arm in arms},
        "warmup": {arm.name: _warmup_summary(arm, warm) for arm in arms},
        "groups": groups,
        "not_benefiting": {arm.name: _not_benefiting(base, arm, timed) for arm in arms[1:]},
    }


def _deltas(
    base: Arm, arm: Arm, metric: str, rows: npt.NDArray[np.int64], rng: np.random.Generator
) -> dict[str, Any]:
    before = getattr(base.derived.batch, metric)[rows]
    after = getattr(arm.derived.batch, metric)[rows]
    present = ~(np.isnan(before) | np.isnan(after))
    if not present.any():
        return {"count": 0}
    out: dict[str, Any] = {"count": int(present.sum())}
    for q in QUANTILES:
        delta = float(np.percentile(after[present], q) - np.percentile(before[present], q))
        pairs = int(present.sum())
        interval = _bootstrap(before[present], after[present], q, rng) if pairs > 1 else None
        out[f"p{q}"] = {
            "baseline": float(np.percentile(before[present], q)),
            "arm": float(np.percentile(after[present], q)),
            "delta": delta,
            "ci95": interval,
        }
    return out


def _bootstrap(
    before: npt.NDArray[np.float64], after: npt.NDArray[np.float64], q: int, rng: np.random.Generator
) -> list[float]:
    """95 % interval of the paired difference of the q-th percentiles (the same resampled
    requests in both arms), resampled in chunks to bound memory."""
    size = before.size
    per_chunk = max(1, 4_000_000 // size)
    deltas = []
    for start in range(0, RESAMPLES, per_chunk):
        picks = rng.integers(0, size, size=(min(per_chunk, RESAMPLES - start), size))
        deltas.append(np.percentile(after[picks], q, axis=1) - np.percentile(before[picks], q, axis=1))
    return [float(v) for v in np.percentile(np.concatenate(deltas), [2.5, 97.5])]


def _reuse(arm: Arm, rows: npt.NDArray[np.int64]) -> dict[str, Any]:
    """The arm's token reuse and modelled compute saved over the group's requests (null when the
    models count work in several units)."""
    mask = np.zeros(len(arm.derived.batch), bool)
    mask[rows] = True
    totals = arm.derived.totals(mask)
    return {"token_reuse_ratio": totals.token_reuse_ratio, "compute_saved_ratio": totals.compute_saved_ratio}


def _warmup_summary(arm: Arm, warm: npt.NDArray[np.bool_]) -> dict[str, Any]:
    totals = arm.derived.totals(warm)
    ttft = arm.derived.batch.ttft_seconds[warm]
    present = ttft[~np.isnan(ttft)]
    return {
        "requests": totals.requests,
        "token_reuse_ratio": totals.token_reuse_ratio,
        "ttft_p50": float(np.percentile(present, 50)) if present.size else None,
    }


def _not_benefiting(base: Arm, arm: Arm, timed: npt.NDArray[np.bool_]) -> dict[str, Any]:
    """Timed requests whose TTFT in this arm is not below the baseline's."""
    before, after = base.derived.batch.ttft_seconds, arm.derived.batch.ttft_seconds
    comparable = timed & ~(np.isnan(before) | np.isnan(after))
    worse = comparable & (after >= before)
    reused = arm.derived.batch.cached_tokens > 0
    examples = [
        {
            "request": int(i) + 1,
            "request_id": arm.derived.batch.request_id[i],
            "prompt_tokens": int(arm.derived.batch.prompt_tokens[i]),
            "cached_tokens": int(arm.derived.batch.cached_tokens[i]),
            "ttft_baseline": float(before[i]),
            "ttft_arm": float(after[i]),
        }
        for i in np.flatnonzero(worse)[:10]
    ]
    return {
        "requests": int(worse.sum()),
        "share": float(worse.sum() / comparable.sum()) if comparable.any() else None,
        "of_which_reused_nothing": int((worse & ~reused).sum()),
        "examples": examples,
    }


TABLE_HEADER = [
    "prompt_len",
    "cache (baseline)",
    "requests",
    "arm",
    "metric",
    "p50 delta ms [95 % CI]",
    "p95 delta ms [95 % CI]",
    "token reuse (arm)",
    "compute saved (arm)",
]


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per group x arm x measured metric, the arm's reuse beside its deltas."""
    rows = []
    for group in result["groups"]:
        for arm, metrics in group["arms"].items():
            reuse = group.get("reuse", {}).get(arm, {})
            for metric, stats in metrics.items():
                if not stats.get("count"):
                    continue
                rows.append(
                    [
                        group["prompt_len"],
                        group["cache_in_baseline"],
                        str(group["requests"]),
                        arm,
                        metric.removesuffix("_seconds"),
                        *(_delta_cell(stats[f"p{q}"]) for q in QUANTILES),
                        _pct(reuse.get("token_reuse_ratio"), 1),
                        _pct(reuse.get("compute_saved_ratio"), 2),
                    ]
                )
    return rows


def verdict(result: dict[str, Any]) -> list[str]:
    """Which arm is faster than the baseline for which groups (the median TTFT, its interval
    decides: wholly below zero is faster, wholly above is slower, else no clear difference), then
    how many requests did not benefit."""
    base = result["baseline"]
    lines = []
    for group in result["groups"]:
        for arm, metrics in group["arms"].items():
            stats = metrics["ttft_seconds"]
            where = f"{group['prompt_len']} tokens, {group['cache_in_baseline']} in {base}"
            if not stats.get("count"):
                lines.append(f"{arm} vs {base}, {where}: TTFT not measured")
                continue
            p50, reuse = stats["p50"], group.get("reuse", {}).get(arm, {})
            lines.append(
                f"{arm} vs {base}, {where} ({stats['count']} requests): "
                f"{_direction(p50['delta'], p50['ci95'])}, median TTFT {_delta_cell(p50)} ms; "
                f"{arm} reused {_pct(reuse.get('token_reuse_ratio'), 1)} of the prompt tokens, "
                f"compute saved {_pct(reuse.get('compute_saved_ratio'), 2)}"
            )
    for arm, info in result["not_benefiting"].items():
        share = "n/a" if info["share"] is None else f"{info['share']:.1%}"
        lines.append(
            f"{arm}: {info['requests']} timed requests ({share}) were not faster than {base}; "
            f"{info['of_which_reused_nothing']} of them reused nothing"
        )
    return lines


def unmeasured(result: dict[str, Any]) -> list[str]:
    """The metrics no timed request has in both arms: a replay client sees TTFT but neither the
    queue nor the prefill; records from the sidecar or the engine carry them."""
    return [
        metric
        for metric in METRICS
        if result["groups"]
        and not any(
            stats[metric].get("count") for group in result["groups"] for stats in group["arms"].values()
        )
    ]


UNMEASURED = "not in these records (a client sees only TTFT; the sidecar's or the engine's records carry it)"


def warmup_lines(result: dict[str, Any]) -> list[str]:
    """Per arm, the warm-up kept out of the timed window, and the one recorded in a file of its
    own (``kvlens experiment prefix-cache``'s warm arm), which is never timed."""
    apart = result.get("warmup_recorded_apart") or {}
    lines = []
    for name, summary in result["warmup"].items():
        line = f"warm-up, {name}: {summary['requests']} requests kept out of the timed window"
        if name in apart:
            line += f"; {apart[name]['requests']} replayed before it, recorded apart in {apart[name]['file']}"
        lines.append(line)
    return lines


def _direction(delta: float, ci: list[float] | None) -> str:
    if ci is None:
        return "faster (one request, no interval)" if delta < 0 else "not faster (one request, no interval)"
    if ci[1] < 0:
        return "faster"
    if ci[0] > 0:
        return "slower"
    return "no clear difference (the interval spans 0)"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# kvlens compare (baseline: {result['baseline']})", ""]
    lines += [f"- {line}" for line in verdict(result)]
    lines.append("")
    lines += [f"- {line}" for line in warmup_lines(result)]
    lines += ["", _md_table(TABLE_HEADER, table_rows(result)), ""]
    lines += [f"- {metric.removesuffix('_seconds')}: {UNMEASURED}" for metric in unmeasured(result)]
    lines += ["", REUSE_IS_NOT_SPEEDUP]
    return "\n".join(lines) + "\n"


def terminal(result: dict[str, Any], console: Any = None) -> None:
    """The comparison as tables (rich), one per compared arm, under the verdict (which carries
    each arm's reuse): at 80 columns a delta and its interval wrap between their numbers, never
    through one."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(f"kvlens compare (baseline: {result['baseline']})", markup=False)
    for line in verdict(result) + warmup_lines(result):
        console.print(line, markup=False)
    rows = table_rows(result)
    for arm in result["arms"][1:]:
        table = Table(title=f"{arm} vs {result['baseline']}: change in ms [95 % CI]")
        for column in ("prompt_len", "cache (baseline)", "requests", "metric", "p50", "p95"):
            table.add_column(column, justify="right", overflow="fold")
        for prompt_len, cache, requests, of, metric, p50, p95, *_ in rows:
            if of == arm:  # the interval under its delta
                deltas = [cell.replace(" [", "\n[", 1) for cell in (p50, p95)]
                table.add_row(prompt_len, cache, f"{int(requests):,}", metric, *deltas)
        console.print(table)
    for metric in unmeasured(result):
        console.print(f"{metric.removesuffix('_seconds')}: {UNMEASURED}", markup=False)
    console.print(REUSE_IS_NOT_SPEEDUP, markup=False)


def _delta_cell(stats: dict[str, Any]) -> str:
    ci = stats["ci95"]
    interval = "" if ci is None else f" [{ci[0] * 1000:+.1f}, {ci[1] * 1000:+.1f}]"
    return f"{stats['delta'] * 1000:+.1f}{interval}"
