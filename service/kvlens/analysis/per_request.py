"""The paired answer of a comparison: which requests waited less in an arm than in the baseline,
by how much, and which did not benefit (article 1's question), request by request.

Requests are matched across arms by ``request_id`` (a replay's ``trace-<index>``, the same in
every arm), never by position. A request is left out of the pairs, and counted, when it has no
``request_id`` in either arm, when its id is in one arm only (``baseline_only`` /
``arm_only``: a record lost or rejected, an error the reader dropped), when its id repeats in an
arm (``duplicate_request_id``: which copy to pair is unknown), or when it has no TTFT in either
arm (``no_ttft``: a failed request). The warm-up is never paired: only the timed window is.

Rows: each compared arm x prompt-length group x the request's outcome *in that arm* (``hit``:
it reused cached tokens there; ``miss``), so that against an ``off`` baseline, where every
request misses, the requests that hit in ``warm`` are still told from those that missed.
Per row: how many waited less, showed no clear change, waited more (beyond the noise floor of
:mod:`kvlens.stats`), the median paired difference with its distribution-free 95 % interval,
and each percentile of the baseline's and the arm's TTFT over those requests with the relative
change. The requests that did not benefit (all but those that waited less) are counted by reason
(``missed``: no cached token in this arm; ``hit_not_faster``: cached tokens and no clear
gain) and the first :data:`MAX_LISTED` of each arm listed with their cached tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvlens import stats
from kvlens.analysis.render import markdown_table, md_lines

MAX_LISTED: Final = 20  # requests that did not benefit, listed per arm (all are counted)
MISSED, HIT_NOT_FASTER = "missed", "hit_not_faster"
REASONS: Final = {
    MISSED: "missed in this arm",
    HIT_NOT_FASTER: "hit but not faster",
}
INTERVAL: Final = (
    "distribution-free 95 % interval of the median (order statistics, binomial ranks): exact for "
    "any distribution of the differences, no resampling"
)


@dataclass(frozen=True)
class Timed:
    """One arm's timed requests (the warm-up left out), in the arm's order."""

    request_id: list[str | None]
    length_group: npt.NDArray[np.intp]
    prompt_tokens: npt.NDArray[np.int64]
    cached_tokens: npt.NDArray[np.int64]
    ttft_seconds: npt.NDArray[np.float64]


def compare(
    names: list[str], arms: list[Timed], labels: list[str], percentiles: tuple[float, ...]
) -> dict[str, Any]:
    """The ``paired`` section of a compare report: each arm after the first against the first."""
    base = arms[0]
    base_index, base_duplicates = _index(base.request_id)
    groups: list[dict[str, Any]] = []
    matching: dict[str, Any] = {}
    not_benefiting: dict[str, Any] = {}
    for name, arm in zip(names[1:], arms[1:], strict=True):
        arm_index, arm_duplicates = _index(arm.request_id)
        duplicates = base_duplicates | arm_duplicates
        common = [i for i in base_index if i in arm_index and i not in duplicates]
        rows_base = np.array([base_index[i] for i in common], dtype=np.intp)
        rows_arm = np.array([arm_index[i] for i in common], dtype=np.intp)
        before, after = base.ttft_seconds[rows_base], arm.ttft_seconds[rows_arm]
        timed = ~(np.isnan(before) | np.isnan(after))
        matching[name] = {
            "pairs": int(timed.sum()),
            "baseline_only": sum(1 for i in base_index if i not in arm_index and i not in duplicates),
            "arm_only": sum(1 for i in arm_index if i not in base_index and i not in duplicates),
            "without_request_id": sum(i is None for i in base.request_id)
            + sum(i is None for i in arm.request_id),
            "duplicate_request_id": len(duplicates),
            "no_ttft": int((~timed).sum()),
        }
        rows_base, rows_arm, before, after = rows_base[timed], rows_arm[timed], before[timed], after[timed]
        length = base.length_group[rows_base]
        hit = arm.cached_tokens[rows_arm] > 0
        outcome = stats.classify(before, after)
        for group in sorted(set(length.tolist())):
            for is_hit in (True, False):
                rows = (length == group) & (hit == is_hit)
                if rows.any():
                    groups.append(
                        _row(
                            name, labels[group], is_hit, before[rows], after[rows], outcome[rows], percentiles
                        )
                    )
        missed = (outcome != -1) & ~hit
        hit_not_faster = (outcome != -1) & hit
        listed = []
        for k in np.flatnonzero(outcome != -1)[:MAX_LISTED]:
            listed.append(
                {
                    "request_id": common_id(base, rows_base[k]),
                    "prompt_len": labels[int(length[k])],
                    "reason": MISSED if not hit[k] else HIT_NOT_FASTER,
                    "prompt_tokens": int(arm.prompt_tokens[rows_arm[k]]),
                    "cached_tokens": int(arm.cached_tokens[rows_arm[k]]),
                    "ttft_baseline_seconds": float(before[k]),
                    "ttft_arm_seconds": float(after[k]),
                }
            )
        not_benefiting[name] = {
            MISSED: int(missed.sum()),
            HIT_NOT_FASTER: int(hit_not_faster.sum()),
            "listed": listed,
        }
    return {
        "matched_by": "request_id",
        "noise_floor": {"seconds": stats.NOISE_FLOOR_SECONDS, "share_of_baseline": stats.NOISE_FLOOR_SHARE},
        "interval": INTERVAL,
        "percentiles": list(percentiles),
        "matching": matching,
        "groups": groups,
        "not_benefiting": not_benefiting,
    }


def common_id(timed: Timed, row: int) -> str:
    request_id = timed.request_id[int(row)]
    assert request_id is not None  # paired rows all have one
    return request_id


def _index(ids: list[str | None]) -> tuple[dict[str, int], set[str]]:
    """Each id's row, in order, and the ids that occur more than once."""
    counts = Counter(i for i in ids if i is not None)
    duplicates = {i for i, count in counts.items() if count > 1}
    return {i: row for row, i in enumerate(ids) if i is not None and i not in duplicates}, duplicates


def _row(
    arm: str,
    length: str,
    hit: bool,
    before: npt.NDArray[np.float64],
    after: npt.NDArray[np.float64],
    outcome: npt.NDArray[np.int8],
    percentiles: tuple[float, ...],
) -> dict[str, Any]:
    median, interval = stats.median_interval(after - before)
    shown = sorted({50.0, *percentiles})  # the median always: the row's headline
    base_values = np.percentile(before, shown)
    arm_values = np.percentile(after, shown)
    by = {
        f"p{stats.percentile_name(q)}": {
            "baseline": float(b),
            "arm": float(a),
            "relative_change": float(a / b - 1) if b > 0 else None,
        }
        for q, b, a in zip(shown, base_values, arm_values, strict=True)
    }
    return {
        "arm": arm,
        "length_group": length,
        "outcome": "hit" if hit else "miss",
        "requests": int(before.size),
        "waited_less": int((outcome == -1).sum()),
        "no_change": int((outcome == 0).sum()),
        "waited_more": int((outcome == 1).sum()),
        "median_delta_seconds": median,
        "ci95": interval,
        "baseline_median_seconds": by["p50"]["baseline"],
        "arm_median_seconds": by["p50"]["arm"],
        "relative_change": by["p50"]["relative_change"],
        "ttft": by,
    }


# ---------------------------------------------------------------------------------------------
# Rendering: one set of rows for the terminal, Markdown and HTML.


def header(section: dict[str, Any]) -> list[str]:
    baseline = section.get("baseline", "baseline")
    return [
        "arm",
        "prompt_len",
        "outcome (arm)",
        "requests",
        "waited less",
        "no clear change",
        "waited more",
        "median change ms [95 % CI]",
        *(f"p{stats.percentile_name(q)} ms {baseline} -> arm" for q in section["percentiles"]),
    ]


def rows(section: dict[str, Any]) -> list[list[str]]:
    out = []
    for group in section["groups"]:
        out.append(
            [
                group["arm"],
                group["length_group"],
                group["outcome"],
                str(group["requests"]),
                str(group["waited_less"]),
                str(group["no_change"]),
                str(group["waited_more"]),
                _median_cell(group),
                *(
                    _values_cell(group["ttft"][f"p{stats.percentile_name(q)}"])
                    for q in section["percentiles"]
                ),
            ]
        )
    return out


def _median_cell(group: dict[str, Any]) -> str:
    ci = group["ci95"]
    interval = " [n/a]" if ci is None else f" [{ci[0] * 1000:+.1f}, {ci[1] * 1000:+.1f}]"
    return f"{group['median_delta_seconds'] * 1000:+.1f}{interval}"


def _values_cell(values: dict[str, Any]) -> str:
    change = values["relative_change"]
    relative = "" if change is None else f" ({change:+.0%})"
    return f"{values['baseline'] * 1000:.1f} -> {values['arm'] * 1000:.1f}{relative}"


LISTED_HEADER: Final = [
    "arm",
    "request_id",
    "prompt_len",
    "reason",
    "cached tokens",
    "TTFT ms baseline -> arm",
]


def listed_rows(section: dict[str, Any]) -> list[list[str]]:
    return [
        [
            arm,
            item["request_id"],
            item["prompt_len"],
            REASONS[item["reason"]],
            f"{item['cached_tokens']:,}",
            f"{item['ttft_baseline_seconds'] * 1000:.1f} -> {item['ttft_arm_seconds'] * 1000:.1f}",
        ]
        for arm, info in section["not_benefiting"].items()
        for item in info["listed"]
    ]


def lines(section: dict[str, Any], baseline: str) -> list[str]:
    """What the table rests on and what it leaves out: the matching, the noise floor, the
    interval, and per arm the requests that did not benefit by reason."""
    floor = section["noise_floor"]
    out = [
        f"paired by request_id: a request waited less (more) when its TTFT in the arm is below "
        f"(above) its TTFT in {baseline} by more than max({floor['seconds'] * 1000:g} ms, "
        f"{floor['share_of_baseline']:.0%} of its {baseline} TTFT); median change with its "
        f"{section['interval']} (n/a: fewer than 6 requests, too few for one)"
    ]
    for arm, matching in section["matching"].items():
        left_out = [
            f"{matching[key]} {what}"
            for key, what in (
                ("baseline_only", f"only in {baseline}"),
                ("arm_only", f"only in {arm}"),
                ("without_request_id", "without request_id"),
                ("duplicate_request_id", "with a repeated request_id"),
                ("no_ttft", "without TTFT in one arm (failed)"),
            )
            if matching[key]
        ]
        info = section["not_benefiting"][arm]
        text = f"{arm} vs {baseline}: {matching['pairs']} requests paired"
        text += f" ({', '.join(left_out)} left out)" if left_out else ""
        text += (
            f"; did not benefit: {info[MISSED]} missed in {arm}, {info[HIT_NOT_FASTER]} hit but not faster"
        )
        out.append(text)
    return out


def markdown(section: dict[str, Any], baseline: str) -> list[str]:
    """The section's Markdown lines."""
    out = ["## Which requests waited less (paired by request)", ""]
    out += md_lines(lines(section, baseline))
    out += ["", markdown_table(header({**section, "baseline": baseline}), rows(section)), ""]
    listed = listed_rows(section)
    if listed:
        out += [
            f"Requests that did not benefit (first {MAX_LISTED} per arm):",
            "",
            markdown_table(LISTED_HEADER, listed),
            "",
        ]
    return out


def terminal(section: dict[str, Any], baseline: str, console: Any) -> None:
    """Two tables per arm at a terminal (80 columns hold neither in one): who waited less, then
    the TTFT percentiles baseline -> arm; then the requests that did not benefit."""
    from rich.table import Table

    console.print("Which requests waited less (paired by request)", markup=False)
    for line in lines(section, baseline):
        console.print(line, markup=False)
    names = [f"p{stats.percentile_name(q)}" for q in section["percentiles"]]
    for arm in section["not_benefiting"]:
        mine = [group for group in section["groups"] if group["arm"] == arm]
        counts = Table(title=f"{arm} vs {baseline}: requests by their TTFT change")
        for column in (
            "prompt_len",
            f"outcome in {arm}",
            "requests",
            "less",
            "same",
            "more",
            "median ms [95 % CI]",
        ):
            counts.add_column(column, justify="right", overflow="fold")
        values = Table(title=f"{arm} vs {baseline}: TTFT ms, {baseline} -> {arm}")
        for column in ("prompt_len", f"outcome in {arm}", *names):
            values.add_column(column, justify="right", overflow="fold")
        for row in rows({**section, "groups": mine}):
            counts.add_row(*row[1:7], row[7].replace(" [", "\n[", 1))
            values.add_row(row[1], row[2], *(cell.replace(" (", "\n(", 1) for cell in row[8:]))
        console.print(counts)
        console.print(values)
    listed = listed_rows(section)
    if listed:
        table = Table(title=f"Requests that did not benefit (first {MAX_LISTED} per arm)")
        for column in LISTED_HEADER:
            table.add_column(column, overflow="fold")
        for row in listed:
            table.add_row(*row)
        console.print(table)
