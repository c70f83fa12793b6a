"""The HTML report of ``kvlens compare`` (and of ``kvlens experiment prefix-cache``): one
self-contained file in the style of the analyze report (:mod:`kvlens.analysis.html_report`,
whose page pieces, colours and style it uses).

It reads top-down as the article's question is asked: the verdict first (which arm is faster
than the baseline for which prompt length x hit group, by how much, with its interval; how many
requests did not benefit), then what it rests on (arms, files, records per arm, warm-up kept
out), then one chart per metric (TTFT, queue, prefill) of each group's median delta against the
baseline with its 95 % interval, the tables (first the paired one: requests matched by
request_id, who waited less per arm x prompt length x outcome in the arm, baseline -> arm
values; then the groups of the baseline with token reuse and compute saved beside each
baseline -> arm value and its change), and the line that reuse is not speedup.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Final

from kvlens.analysis import compare_text, per_request, run_facts
from kvlens.analysis.html_report import (
    LATENCY_CHARTS,
    STYLE,
    figure_html,
    html_table,
    legend_svg,
    linear_axis,
    linear_ticks,
    section_html,
    svg_open,
)
from kvlens.analysis.html_report import SERIES as CACHE_COLOURS

EXAMPLE_HEADER: Final = [
    "arm",
    "request",
    "request_id",
    "prompt tokens",
    "cached",
    "TTFT base ms",
    "TTFT arm ms",
]
COMPARE_STYLE: Final = "#caveat{font-weight:600;border-left:4px solid #6b7785;padding-left:.6rem}"


def page(result: dict[str, Any]) -> str:
    """The compare result (:func:`kvlens.analysis.compare.compare`) as one HTML page."""
    body = [
        "<header><h1>kvlens compare</h1></header>",
        _verdict(result),
        _context(result),
        section_html("deltas", f"Deltas against {html.escape(result['baseline'])}", _charts(result)),
        section_html("tables", "Tables", _tables(result)),
        f'<p id="caveat">{html.escape(compare_text.REUSE_IS_NOT_SPEEDUP)}</p>',
        f"<p>{html.escape(run_facts.PRESUMES_QUALITY)}</p>",
        '<details class="data"><summary>Report data (JSON)</summary>'
        f'<pre id="report-data">{html.escape(json.dumps(result))}</pre></details>',
    ]
    title = f"kvlens compare: {', '.join(result['arms'])}"
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"/>'
        '<meta name="viewport" content="width=device-width,initial-scale=1"/>'
        f"<title>{html.escape(title)}</title><style>{STYLE}{COMPARE_STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def write(result: dict[str, Any], path: Path) -> None:
    path.write_text(page(result))


def _verdict(result: dict[str, Any]) -> str:
    if not result["groups"]:
        return section_html("verdict", "Verdict", '<p class="lead">No timed request to compare.</p>')
    lead = (
        f"Against {html.escape(result['baseline'])}, per prompt length and cache status in the "
        "baseline: the median TTFT delta and its 95 % interval (faster when the whole interval is "
        "below zero)."
    )
    items = "".join(f"<li>{html.escape(line)}</li>" for line in compare_text.verdict(result))
    return section_html("verdict", "Verdict", f'<p class="lead">{lead}</p><ul class="findings">{items}</ul>')


def _paired(result: dict[str, Any]) -> str:
    """The paired answer (requests matched by request_id): the table first, then the requests
    that did not benefit with their reason and cached tokens."""
    section = result.get("paired")
    if section is None:
        return ""
    baseline = result["baseline"]
    notes = "".join(f"<li>{html.escape(line)}</li>" for line in per_request.lines(section, baseline))
    out = (
        '<h3 id="paired">Which requests waited less (paired by request)</h3>'
        f'<ul class="findings">{notes}</ul>'
        + html_table(per_request.header({**section, "baseline": baseline}), per_request.rows(section))
    )
    listed = per_request.listed_rows(section)
    if listed:
        out += (
            f"<h3>Requests that did not benefit (first {per_request.MAX_LISTED} per arm)</h3>"
            + html_table(per_request.LISTED_HEADER, listed)
        )
    return out


def _context(result: dict[str, Any]) -> str:
    files = result.get("files") or {}
    rows = [
        ("Arms", html.escape(", ".join(result["arms"])) + f" (baseline: {html.escape(result['baseline'])})"),
        (
            "Files",
            "<ul>"
            + "".join(
                f"<li>{html.escape(arm)}: <code>{html.escape(files.get(arm) or 'not a file')}</code></li>"
                for arm in result["arms"]
            )
            + "</ul>",
        ),
        ("Records per arm", f"{result['requests']:,} (the same requests in the same order in every arm)"),
        *(
            [
                (
                    "Failed requests",
                    "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in failed) + "</ul>",
                )
            ]
            if (failed := run_facts.error_lines(result))
            else []
        ),
        (
            "Warm-up excluded",
            "<ul>"
            + "".join(
                f"<li>{html.escape(line.removeprefix('warm-up, '))}</li>"
                for line in compare_text.warmup_lines(result)
            )
            + "</ul>",
        ),
    ]
    items = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in rows)
    return section_html("context", "Context", f"<dl>{items}</dl>")


def _charts(result: dict[str, Any]) -> str:
    missing = compare_text.unmeasured(result)
    charts = [
        f'<p class="unmeasured" data-metric="{column}">{name}: {html.escape(compare_text.UNMEASURED)}.</p>'
        if column in missing
        else _delta_chart(result, column, name)
        for column, name in LATENCY_CHARTS
    ]
    return "".join(chart for chart in charts if chart) or "<p>No timed request to compare.</p>"


def _delta_chart(result: dict[str, Any], column: str, name: str, width: int = 760) -> str:
    """One row per group x arm: a dot at the median delta (arm minus baseline), the whisker its 95 %
    interval, on one axis in ms with zero marked; the colour is the group's cache status in the
    baseline."""
    rows = [
        (group, arm, metrics[column]["p50"])
        for group in result["groups"]
        for arm, metrics in group["arms"].items()
        if metrics[column].get("count")
    ]
    if not rows:
        return ""
    ends = [abs(v) for _, _, p50 in rows for v in (p50["delta"], *(p50["ci95"] or ()))]
    half = linear_ticks(max(ends))
    ticks = [-t for t in reversed(half[1:])] + half
    low, high = ticks[0], ticks[-1]
    left, right, row = 170, 230, 22
    plot = width - left - right
    height = 40 + row * len(rows) + 40
    colours = dict(CACHE_COLOURS)

    def x(value: float) -> float:
        return left + plot * (value - low) / (high - low)

    parts = [legend_svg(left, 6)]
    zero = x(0.0)
    parts.append(f'<line x1="{zero:.1f}" x2="{zero:.1f}" y1="26" y2="{30 + row * len(rows)}" class="axis"/>')
    y = 30
    for group, arm, p50 in rows:
        cache = group["cache_in_baseline"]
        colour = colours[cache]
        middle = y + row / 2
        ci = p50["ci95"]
        parts.append(
            f'<g class="delta" data-length="{html.escape(group["prompt_len"])}" data-cache="{cache}" '
            f'data-arm="{html.escape(arm)}" data-fill="{colour}">'
            f'<text x="{left - 8}" y="{middle + 4:.1f}" text-anchor="end" class="label">'
            f"{html.escape(group['prompt_len'])} {cache} &#183; {html.escape(arm)}</text>"
        )
        if ci is not None:
            parts.append(
                f'<line x1="{x(ci[0]):.1f}" x2="{x(ci[1]):.1f}" y1="{middle:.1f}" y2="{middle:.1f}" '
                f'stroke="{colour}" stroke-width="2"/>'
            )
        shown = f"{compare_text.delta_cell(p50)} ms"
        what = f"{arm} minus {result['baseline']}, {group['prompt_len']} {cache}: {shown}"
        parts.append(
            f'<circle cx="{x(p50["delta"]):.1f}" cy="{middle:.1f}" r="4" fill="{colour}">'
            f"<title>{html.escape(what)}</title></circle>"
            f'<text x="{left + plot + 8}" y="{middle + 4:.1f}" class="value">{shown}</text></g>'
        )
        y += row
    parts.append(linear_axis(left, plot, y + 4, ticks))
    parts.append(
        f'<text x="{left + plot / 2}" y="{height - 2}" text-anchor="middle" class="axis-title">'
        f"{name}: arm minus {html.escape(result['baseline'])}, median (ms)</text>"
    )
    label = (
        f"{name}: per prompt-length group and arm, the median delta against {result['baseline']} "
        "with its 95 % interval, in milliseconds; left of zero is faster"
    )
    caption = (
        f"{html.escape(name)}: dot, the arm's median minus the baseline's; whisker, the paired "
        "bootstrap 95 % interval (printed right, in ms); left of the zero line is faster. Colour: "
        "the group's cache status in the baseline arm."
    )
    return figure_html(svg_open(width, height, label) + "".join(parts) + "</svg>", caption)


def _tables(result: dict[str, Any]) -> str:
    examples = [
        [
            arm,
            str(e["request"]),
            str(e["request_id"] or "-"),
            f"{e['prompt_tokens']:,}",
            f"{e['cached_tokens']:,}",
            f"{1000 * e['ttft_baseline']:.1f}",
            f"{1000 * e['ttft_arm']:.1f}",
        ]
        for arm, info in result["not_benefiting"].items()
        for e in info["examples"]
    ]
    out = (
        _paired(result)
        + "<h3>By prompt length and cache status in the baseline</h3>"
        + html_table(compare_text.table_header(result), compare_text.table_rows(result))
    )
    if examples:
        out += "<h3>Requests that did not benefit (first ten per arm)</h3>" + html_table(
            EXAMPLE_HEADER, examples
        )
    return out
