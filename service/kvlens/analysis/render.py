"""Render an analyze report: terminal tables (rich) or Markdown. The HTML report is
:mod:`kvlens.analysis.html_report` (it reuses the rows and lines made here)."""

from __future__ import annotations

import re
from typing import Any

from kvlens.analysis import sessions
from kvlens.terminal import console as terminal_console
from kvlens.terminal import percent, printable, visible

RATIO_NAMES = (
    ("request_hit_ratio", "Request hit ratio"),
    ("token_reuse_ratio", "Token reuse ratio"),
    ("compute_saved_ratio", "Compute saved (modelled)"),
)


def _ratio(key: str, value: float | None) -> str:
    """Compute saved is small by nature: one more digit."""
    return percent(value, 3 if key == "compute_saved_ratio" else 2)


def milliseconds(value: float | None) -> str:
    return "n/a" if value is None else f"{1000 * value:.1f}"


STAGES = (("ttft_seconds", "TTFT"), ("queue_seconds", "queue"), ("prefill_seconds", "prefill"))
PERCENTILES = ("p50", "p95", "p99")


def _share_cells(group: dict[str, Any]) -> list[str]:
    return [
        group["prompt_len"],
        group["cache"],
        f"{group['requests']:,}",
        percent(group["share_of_requests"], 1),
        percent(group["share_of_tokens"], 1),
        percent(group["share_of_work"], 1),
    ]


def group_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per group, its percentiles as ``p50 / p95 / p99`` in one cell per stage."""
    return [
        [
            *_share_cells(group),
            *(" / ".join(milliseconds(group[stage][p]) for p in PERCENTILES) for stage, _ in STAGES),
        ]
        for group in report["groups"]
    ]


GROUP_HEADER = [
    "prompt_len",
    "cache",
    "requests",
    "of requests",
    "of tokens",
    "of work",
    "TTFT p50/p95/p99 ms",
    "queue p50/p95/p99 ms",
    "prefill p50/p95/p99 ms",
]
SHARE_HEADER = GROUP_HEADER[:6]


def _compute_saved(totals: dict[str, Any]) -> str:
    """The compute-saved ratio with its unit; one per unit when models count work in several."""
    work = totals.get("work") or {}
    if len(work) <= 1:
        return _ratio("compute_saved_ratio", totals["compute_saved_ratio"]) + (
            f" ({next(iter(work))})" if work else ""
        )
    return ", ".join(
        f"{_ratio('compute_saved_ratio', w['compute_saved_ratio'])} ({unit})" for unit, w in work.items()
    )


def model_row(name: str, model: dict[str, Any]) -> list[str]:
    return [
        name,
        f"{model['requests']:,}",
        _ratio("request_hit_ratio", model["request_hit_ratio"]),
        _ratio("token_reuse_ratio", model["token_reuse_ratio"]),
        _compute_saved(model),
    ]


MODEL_HEADER = ["model", "requests", "request hit", "token reuse", "compute saved (unit)"]


def has_records(report: dict[str, Any]) -> bool:
    return bool(report["input"]["files"])


def summary_lines(report: dict[str, Any]) -> list[str]:
    source = report["input"]
    overall = report["overall"]
    lines = [
        f"{overall['requests']:,} requests from {source['lines']:,} lines "
        f"({source['skipped_total']:,} skipped) in {len(source['files'])} file(s)",
    ]
    lines += [f"{title}: {_ratio(key, overall[key])}" for key, title in RATIO_NAMES[:2]]
    lines.append(f"Compute saved (modelled): {_compute_saved(overall)}")
    decomposition = report["ttft_decomposition"]
    if decomposition["requests"]:
        lines.append(
            "TTFT decomposition: "
            + ", ".join(
                f"{name} {percent(decomposition[f'{name}_share'], 1)}"
                for name in ("queue", "prefill", "other")
            )
        )
    slowest = report["slowest"]
    if slowest["requests"]:
        where = ", ".join(
            f"{g['prompt_len']} {g['cache']} {percent(g['share'], 0)}" for g in slowest["groups"][:4]
        )
        lines.append(f"Slowest 5 % (TTFT >= {milliseconds(slowest['threshold_seconds'])} ms): {where}")
    return lines + sessions.lines(report.get("sessions"))


def terminal(report: dict[str, Any]) -> None:
    console = terminal_console()  # names from the records are text, never markup
    if has_records(report):
        _terminal_records(console, report)
    for fit in report["calibration"]:
        for line in calibration_lines(fit):
            console.print(line)


def _terminal_records(console: Any, report: dict[str, Any]) -> None:
    from rich.text import Text

    for line in summary_lines(report):
        console.print(line)
    for table in _group_tables(console, report):
        console.print(table)
    models = _table("By model", MODEL_HEADER)
    for name, model in report["models"].items():
        models.add_row(*model_row(name, model))
    console.print(models)
    if report.get("misses"):
        misses = _table(
            "Why requests missed (first missed block's cause; lost: reuse computed before)", MISS_HEADER
        )
        for row in _miss_rows(report["misses"]):
            misses.add_row(*row)
        console.print(misses)
        for line in [*_worst_lines(report["misses"]), report["misses"]["note"]]:
            console.print(line, markup=False)
    for item in report["diagnosis"]:
        console.print(
            # a Text is no string rich renders through the console's printable(): its parts are
            Text.assemble(
                (item["severity"].upper(), "bold"),
                f" {printable(item['title'])}\n  {printable(item['detail'])}",
            )
        )
    if "cross_tenant" in report:
        console.print(_cross_tenant_line(report["cross_tenant"]))
        if report["cross_tenant"]["pairs"]:
            shared = _table("Tenants sharing a cache scope", CROSS_TENANT_HEADER)
            for row in _cross_tenant_rows(report["cross_tenant"]):
                shared.add_row(*row)
            console.print(shared)
    for example in report["input"]["skipped_examples"][:5]:
        console.print(
            f"skipped {example['file']}:{example['line']}: {example['field'] or 'line'} {example['message']}"
        )


CROSS_TENANT_HEADER = ["storer", "getter", "cached tokens", "requests", "first request ids"]


def _cross_tenant_line(section: dict[str, Any]) -> str:
    return (
        f"Cross-tenant cache reuse: {section['cross_tenant_cached_tokens']:,} cached tokens over blocks "
        f"another tenant stored, in {section['records_checked']:,} records with a tenant and prefix_hashes"
    )


def _cross_tenant_rows(section: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            p["storer"],
            p["getter"],
            f"{p['cached_tokens']:,}",
            f"{p['requests']:,}",
            ", ".join(p["example_request_ids"]),
        ]
        for p in section["pairs"]
    ]
    if section["pairs_left_out"]:
        rows.append(["", f"{section['pairs_left_out']:,} more pairs", "", "", ""])
    return rows


def _table(title: str, header: list[str]) -> Any:
    """A table whose cells wrap between words but never cut one: a number too wide for its
    column folds onto the next line instead of losing its digits to an ellipsis."""
    from rich.table import Table

    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="right", overflow="fold")
    return table


def _group_tables(console: Any, report: dict[str, Any]) -> list[Any]:
    """The groups in one table, each percentile in its column, when the terminal is wide enough;
    otherwise their shares, then their latencies one stage a row (80 columns hold both)."""
    from rich.measure import Measurement

    wide = _table(
        "By prompt length and hit status (latency in ms)",
        SHARE_HEADER + [f"{name} {p}" for _, name in STAGES for p in PERCENTILES],
    )
    for group in report["groups"]:
        wide.add_row(
            *_share_cells(group), *(milliseconds(group[s][p]) for s, _ in STAGES for p in PERCENTILES)
        )
    natural = Measurement.get(console, console.options.update_width(1 << 16), wide).maximum
    if natural <= console.width:
        return [wide]
    shares = _table("By prompt length and hit status", SHARE_HEADER)
    latency = _table(
        "Latency by prompt length and hit status, ms", ["prompt_len", "cache", "stage", *PERCENTILES]
    )
    for group in report["groups"]:
        shares.add_row(*_share_cells(group))
        for i, (stage, name) in enumerate(STAGES):
            label = [group["prompt_len"], group["cache"]] if i == 0 else ["", ""]
            latency.add_row(
                *label, name, *(milliseconds(group[stage][p]) for p in PERCENTILES), end_section=i == 2
            )
    return [shares, latency]


def calibration_lines(fit: dict[str, Any]) -> list[str]:
    """The fit, how it compares with the alternatives, and (for measured points) the saved
    fraction at half-cached prompts: measured, fitted, as exported, and in FLOPs."""

    def quality(q: dict[str, Any]) -> str:
        r2 = "n/a" if q["r2"] is None else f"{q['r2']:.3f}"
        error = "n/a" if q["median_error"] is None else f"{100 * q['median_error']:.1f} %"
        return f"R^2 {r2}, median error {error}"

    per = " per layer" if fit["per_layer"] else ""
    ratio = f", b/a = 1/{fit['pairs_per_token']:,.0f}" if fit["pairs_per_token"] else ""
    lines = [
        f"calibration {fit['model']} ({fit['requests']:,} {fit['source']}): "
        f"a={fit['a_seconds_per_token']:.3g} s/token, b={fit['b_seconds_per_pair']:.3g} s/pair, "
        f"c={fit['c_seconds']:.3g} s{per}{ratio}; "
        f"{quality(fit)} ({fit['reason']})"
    ]
    lines += [f"  vs {name.replace('_', ' ')}: {quality(q)}" for name, q in fit["alternatives"].items()]
    for saved in fit["saved_fraction"]:
        if 2 * saved["h"] == saved["n"]:
            flops = "" if saved["flops"] is None else f", FLOPs {saved['flops']:.3f}"
            lines.append(
                f"  saved at n={saved['n']:,}, h={saved['h']:,}: measured {saved['measured']:.3f}, "
                f"fitted {saved['fitted']:.3f}, cost model {saved['cost_model']:.3f}{flops}"
            )
    return lines


def markdown(report: dict[str, Any]) -> str:
    out = ["# kvlens analyze", ""]
    if has_records(report):
        out += _markdown_records(report)
    if report["calibration"]:
        out += ["## Calibration", ""]
        out += md_lines([line.strip() for fit in report["calibration"] for line in calibration_lines(fit)])
    return "\n".join(out) + "\n"


def _markdown_records(report: dict[str, Any]) -> list[str]:
    out = md_lines(summary_lines(report))
    out += [
        "",
        "## By prompt length and hit status",
        "",
        markdown_table(GROUP_HEADER, group_rows(report)),
        "",
    ]
    out += ["## By model", ""]
    model_rows = [model_row(name, m) for name, m in report["models"].items()]
    out += [markdown_table(MODEL_HEADER, model_rows), ""]
    if report.get("misses"):
        out += ["## Why requests missed", "", markdown_table(MISS_HEADER, _miss_rows(report["misses"])), ""]
        out += md_lines(_worst_lines(report["misses"]))
        out += ["", report["misses"]["note"], ""]
    out += ["## Diagnosis", ""]
    out += [
        f"- **{d['severity']}** {md_text(d['title'])}: {md_text(d['detail'])}" for d in report["diagnosis"]
    ] or ["- nothing found"]
    if "cross_tenant" in report:
        section = report["cross_tenant"]
        out += ["", "## Tenants sharing a cache scope", "", *md_lines([_cross_tenant_line(section)])]
        if section["pairs"]:
            out += ["", markdown_table(CROSS_TENANT_HEADER, _cross_tenant_rows(section))]
    return [*out, ""]


MISS_HEADER = ["prompt_len", "records", "hit", "new", "evicted_here", "elsewhere", "lost tokens", "lost work"]


def _miss_rows(misses: dict[str, Any]) -> list[list[str]]:
    """Per length group: records by their first missed block's cause, and the reuse lost."""
    rows = []
    for label, group in misses["groups"].items():
        first = group["first_miss"]
        elsewhere = first["held_elsewhere"] + first["evicted_elsewhere"] + first["seen_elsewhere"]
        lost_tokens = sum(t for cause, t in group["tokens"].items() if cause != "new")
        lost_work = [
            f"{sum(w for cause, w in by_cause.items() if cause != 'new'):,.4g} {unit}"
            for unit, by_cause in group["work"].items()
        ]
        rows.append(
            [
                label,
                f"{group['records']:,}",
                f"{first['hit']:,}",
                f"{first['new']:,}",
                f"{first['evicted_here']:,}",
                f"{elsewhere:,}",
                f"{lost_tokens:,}",
                ", ".join(lost_work) or "0",
            ]
        )
    return rows


def _worst_lines(misses: dict[str, Any]) -> list[str]:
    return [
        f"{label}: {w['request_id'] or '(no id)'} on {w['replica'] or '(one replica)'} lost "
        f"{w['lost_work']:,.4g} {w['unit']} ({w['lost_tokens']:,} tokens), first miss at block "
        f"{w['first_missed_block']}: {w['cause']}"
        for label, group in misses["groups"].items()
        for w in group["worst"]
    ]


# What Markdown would read inside a line: the backslash itself, a cell's end (|), code (`),
# emphasis (* and ~ anywhere, _ at a word's edge: between letters it is text), HTML and entities
# (< and &), a link's or image's target (]( ).
_MD_SPECIAL = re.compile(r"[\\|`*~<&]|\](?=\()|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
# What would open a block at a bullet's start (in a cell or mid-line it is text): a heading (#),
# a quote (>), a list ("- ", "+ ") or a rule (---), a numbered list ("1. ", "1) ").
_MD_BLOCK = re.compile(r"^(?:[#>]|[-+](?=\s|$|-))")
_MD_NUMBERED = re.compile(r"^(\d+)([.)])(?=\s|$)")


def md_text(text: str) -> str:
    """``text`` as Markdown showing it as written, in a line or a table's cell: every name from
    the records and the command line (an arm ``a|b`` or ``*x*``, a request id or a file name with
    a newline, an endpoint ``[l](url)``) goes into kvlens's Markdown through here or
    :func:`md_lines`, so it never ends its line or its row, splits a cell or becomes markup.
    Control characters are shown as their escapes (:func:`kvlens.terminal.visible`: ``a\\nb``).
    Numbers and words pass unchanged."""
    return visible(_MD_SPECIAL.sub(lambda found: "\\" + found.group(), text))


def md_lines(lines: list[str]) -> list[str]:
    """Lines of text (the terminal's, holding names) as Markdown bullets, each through
    :func:`md_text`, and a start that would open a block (``# h``, ``1. x``) escaped."""
    return [
        "- " + _MD_NUMBERED.sub(r"\1\\\2", _MD_BLOCK.sub(lambda found: "\\" + found.group(), md_text(line)))
        for line in lines
    ]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """Every Markdown table of kvlens (analyze, compare, an experiment's report.md): each cell
    through :func:`md_text`."""
    lines = ["| " + " | ".join(map(md_text, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(md_text, row)) + " |" for row in rows]
    return "\n".join(lines)
