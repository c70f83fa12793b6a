"""The compare report (:func:`kvlens.analysis.compare.compare`) as text: the verdict, the table
of percentiles per group and arm, Markdown and the terminal's tables. The HTML page
(:mod:`kvlens.analysis.html_compare`) is built from the same lines and rows.
"""

from __future__ import annotations

from typing import Any

from kvlens import stats
from kvlens.analysis import per_request, run_facts, sessions
from kvlens.analysis.compare import METRICS
from kvlens.analysis.render import markdown_table, md_lines, md_text
from kvlens.terminal import console as terminal_console
from kvlens.terminal import percent

REUSE_IS_NOT_SPEEDUP = (
    "Reuse is not speedup: cached tokens save prefill work, and TTFT falls only where prefill, "
    "not queueing, was the wait."
)


def shown_percentiles(result: dict[str, Any]) -> list[float]:
    """The report's percentiles (p50 and p95 in a report from before ``--percentiles``)."""
    return [float(q) for q in result.get("percentiles", (50, 95))]


def table_header(result: dict[str, Any]) -> list[str]:
    return [
        "prompt_len",
        "cache (baseline)",
        "requests",
        "arm",
        "metric",
        *(
            f"p{stats.percentile_name(q)} ms {result['baseline']} -> arm, change [95 % CI]"
            for q in shown_percentiles(result)
        ),
        "token reuse (arm)",
        "compute saved (arm)",
    ]


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per group x arm x measured metric, the arm's reuse beside its deltas."""
    rows = []
    for group in result["groups"]:
        for arm, metrics in group["arms"].items():
            reuse = group.get("reuse", {}).get(arm, {})
            for metric, values in metrics.items():
                if not values.get("count"):
                    continue
                rows.append(
                    [
                        group["prompt_len"],
                        group["cache_in_baseline"],
                        str(group["requests"]),
                        arm,
                        metric.removesuffix("_seconds"),
                        *(
                            values_cell(values[f"p{stats.percentile_name(q)}"])
                            for q in shown_percentiles(result)
                        ),
                        percent(reuse.get("token_reuse_ratio"), 1),
                        percent(reuse.get("compute_saved_ratio"), 2),
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
            ttft = metrics["ttft_seconds"]
            where = f"{group['prompt_len']} tokens, {group['cache_in_baseline']} in {base}"
            if not ttft.get("count"):
                lines.append(f"{arm} vs {base}, {where}: TTFT not measured")
                continue
            p50, reuse = ttft["p50"], group.get("reuse", {}).get(arm, {})
            lines.append(
                f"{arm} vs {base}, {where} ({ttft['count']} requests): "
                f"{_direction(p50['delta'], p50['ci95'])}, median TTFT {delta_cell(p50)} ms; "
                f"{arm} reused {percent(reuse.get('token_reuse_ratio'), 1)} of the prompt tokens, "
                f"compute saved {percent(reuse.get('compute_saved_ratio'), 2)}"
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
            values[metric].get("count") for group in result["groups"] for values in group["arms"].values()
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
    lines = [f"# kvlens compare (baseline: {md_text(result['baseline'])})", ""]
    if "paired" in result:  # the article's question first: which requests waited less
        lines += per_request.markdown(result["paired"], result["baseline"])
        lines += ["## By prompt length and cache status in the baseline", ""]
    lines += md_lines(verdict(result))
    lines.append("")
    lines += md_lines(
        warmup_lines(result) + run_facts.error_lines(result) + sessions.arm_lines(result.get("sessions"))
    )
    lines += ["", markdown_table(table_header(result), table_rows(result)), ""]
    lines += md_lines([f"{metric.removesuffix('_seconds')}: {UNMEASURED}" for metric in unmeasured(result)])
    lines += ["", REUSE_IS_NOT_SPEEDUP, "", run_facts.PRESUMES_QUALITY]
    return "\n".join(lines) + "\n"


def terminal(result: dict[str, Any], console: Any = None) -> None:
    """The comparison as tables (rich), one per compared arm, under the verdict (which carries
    each arm's reuse): at 80 columns a delta and its interval wrap between their numbers, never
    through one."""
    from rich.table import Table

    console = console or terminal_console()  # arm names and request ids are text, never markup
    console.print(f"kvlens compare (baseline: {result['baseline']})", markup=False)
    if "paired" in result:
        per_request.terminal(result["paired"], result["baseline"], console)
    for line in (
        verdict(result)
        + warmup_lines(result)
        + run_facts.error_lines(result)
        + sessions.arm_lines(result.get("sessions"))
    ):
        console.print(line, markup=False)
    rows = table_rows(result)
    names = [f"p{stats.percentile_name(q)}" for q in shown_percentiles(result)]
    for arm in result["arms"][1:]:
        # one row per percentile: 80 columns hold the values and the interval of one, not of four
        base = result["baseline"]
        table = Table(title=f"{arm} vs {base}: {base} -> {arm} in ms, change [95 % CI]")
        shown = []
        for prompt_len, cache, requests, of, metric, *cells in rows:
            if of != arm:
                continue
            for name, cell in zip(names, cells, strict=False):
                values, change = cell.split(", ", 1)
                first = name == names[0]
                shown.append(
                    [
                        prompt_len if first else "",
                        cache if first else "",
                        f"{int(requests):,}" if first else "",
                        metric if first else "",
                        name,
                        values.replace(" -> ", " ->\n", 1),  # wrap between numbers, never through one
                        change.replace(" [", "\n[", 1).replace(", ", ",\n", 1),
                    ]
                )
        for index, column in enumerate(
            ("prompt_len", f"cache in {base}", "requests", "metric", "", "ms", "change")
        ):
            # each column as wide as its widest cell line or header word: rich would widen some
            # and fold the numbers of others
            widest = max(
                [len(line) for row in shown for line in row[index].splitlines()]
                + [len(w) for w in column.split()]
            )
            table.add_column(column, justify="right", overflow="fold", min_width=widest, max_width=widest)
        for row in shown:
            table.add_row(*row)
        console.print(table)
    for metric in unmeasured(result):
        console.print(f"{metric.removesuffix('_seconds')}: {UNMEASURED}", markup=False)
    console.print(REUSE_IS_NOT_SPEEDUP, markup=False)
    console.print(run_facts.PRESUMES_QUALITY, markup=False)


def delta_cell(values: dict[str, Any]) -> str:
    ci = values["ci95"]
    interval = "" if ci is None else f" [{ci[0] * 1000:+.1f}, {ci[1] * 1000:+.1f}]"
    return f"{values['delta'] * 1000:+.1f}{interval}"


def values_cell(values: dict[str, Any]) -> str:
    """``8.7 -> 2.7, -6.0 [-6.4, -5.6]``: baseline -> arm in ms, then the change and its interval."""
    return f"{values['baseline'] * 1000:.1f} -> {values['arm'] * 1000:.1f}, {delta_cell(values)}"
