"""The HTML report of ``kvlens analyze``: one self-contained file (inline CSS and SVG, no script,
no external fetch: it opens offline and prints as it shows).

It reads top-down as an operator troubleshoots: the verdict first (the findings of
:mod:`kvlens.analysis.diagnosis`, already in the order of DESIGN section 6), then what the
numbers rest on (time range, files, records accepted and rejected, the cost model and its unit),
then the key numbers, hit beside miss at equal prompt length (TTFT, queue, prefill), the tables,
and the calibration (measured prefill against the fitted curve, on log axes when the data spans
more than a decade).
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final

from kvlens.analysis import render
from kvlens.definitions import FLOPS, SECONDS, WORK_UNITS, CostModel
from kvlens.terminal import percent

# Okabe-Ito blue and vermillion: told apart with the common colour-vision deficiencies and in
# greyscale print (different lightness).
HIT_COLOUR: Final = "#0072B2"
MISS_COLOUR: Final = "#D55E00"
NEUTRAL_COLOUR: Final = "#5f6b7a"
INK: Final = "#1d232a"
SERIES: Final = (("hit", HIT_COLOUR), ("miss", MISS_COLOUR))
MAX_LISTED: Final = 20  # input paths named in the context; the rest are counted
LOG_SPAN: Final = 10.0  # an axis whose data spans more than this factor is drawn on a log scale
LATENCY_CHARTS: Final = (
    ("ttft_seconds", "Time to first token"),
    ("queue_seconds", "Queue time"),
    ("prefill_seconds", "Prefill time"),
)
UNIT_MEANING: Final = {
    WORK_UNITS: "the article's illustrative unit (a = 1 per token, b = 1/1024 per pair), not time",
    FLOPS: "floating-point operations from the model's shape",
    SECONDS: "prefill seconds, fitted to measured times",
}
CHECKS: Final = (
    "little reuse (template and traffic structure)",
    "reuse high but prefill not faster at equal length",
    "TTFT queue-bound",
    "a flattering request hit ratio",
)


def page(report: dict[str, Any], cost_for: Callable[[str], CostModel]) -> str:
    """The report as one HTML page; ``cost_for`` gives the cost model the report's modelled work
    was computed with (:meth:`kvlens.accounting.Accounting.cost_model_for`)."""
    records = render.has_records(report)
    body = [
        "<header><h1>kvlens analyze</h1></header>",
        _verdict(report),
        _context(report, cost_for),
    ]
    if records:
        body += [
            section_html("numbers", "Key numbers", _key_numbers(report)),
            section_html("latency", "Hit and miss at equal prompt length", _latency(report)),
            section_html("tables", "Tables", _tables(report)),
        ]
    body.append(section_html("calibration", "Calibration", _calibration(report["calibration"])))
    data = html.escape(json.dumps(report))
    body.append(
        '<details class="data"><summary>Report data (JSON)</summary>'
        f'<pre id="report-data">{data}</pre></details>'
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"/>'
        '<meta name="viewport" content="width=device-width,initial-scale=1"/>'
        f"<title>{html.escape(_title(report))}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def _title(report: dict[str, Any]) -> str:
    findings = len(report["diagnosis"])
    return f"kvlens analyze: {findings} finding{'' if findings == 1 else 's'}"


def section_html(anchor: str, title: str, content: str) -> str:
    return (
        f'<section id="{anchor}" aria-labelledby="{anchor}-title">'
        f'<h2 id="{anchor}-title">{title}</h2>{content}</section>'
    )


# --- verdict and context ------------------------------------------------------------------


def _verdict(report: dict[str, Any]) -> str:
    findings = report["diagnosis"]
    if findings:
        lead = (
            f"{len(findings)} finding{'' if len(findings) == 1 else 's'}, in troubleshooting order "
            "(reuse first, then whether prefill is faster, then queueing):"
        )
        items = "".join(
            f'<li class="finding {html.escape(d["severity"])}" data-finding="{html.escape(d["id"])}">'
            f'<span class="severity">{html.escape(d["severity"].upper())}</span> '
            f"<b>{html.escape(d['title'])}</b><br/>{html.escape(d['detail'])}</li>"
            for d in findings
        )
        content = f'<p class="lead">{lead}</p><ol class="findings">{items}</ol>'
    elif report["overall"]["requests"]:
        content = f'<p class="lead">No finding. Checked, in troubleshooting order: {"; ".join(CHECKS)}.</p>'
    else:
        content = '<p class="lead">No record accepted, nothing to judge: only the calibration below.</p>'
    return section_html("verdict", "Verdict", content)


def _context(report: dict[str, Any], cost_for: Callable[[str], CostModel]) -> str:
    source = report["input"]
    rows = [
        ("Time range", _time_range(source.get("time_range"))),
        ("Input files", _files(source)),
        ("Records", _counts(source)),
        ("Cost model", _cost_models(report, cost_for)),
    ]
    items = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in rows)
    return section_html("context", "Context", f"<dl>{items}</dl>")


def _time_range(span: dict[str, Any] | None) -> str:
    if not span or span.get("first_arrival") is None:
        return "not known: no record carries an arrival_time"

    def stamp(seconds: float) -> str:
        return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    first, last = span["first_arrival"], span["last_arrival"]
    seconds = last - first
    length = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"
    counted = f"{span['records']:,} records with an arrival_time"
    return html.escape(f"{stamp(first)} to {stamp(last)} ({length}; {counted})")


def _files(source: dict[str, Any]) -> str:
    """The paths as given (a directory or glob stands for many files), then the files read by
    format; a long list is cut, not the counts."""
    if not source["files"]:
        return "none (calibration points only)"
    formats = source["formats"]
    listed = "".join(
        f"<li><code>{html.escape(path)}</code>"
        + (f" ({html.escape(formats[path])})" if path in formats else "")
        + "</li>"
        for path in source["files"][:MAX_LISTED]
    )
    more = len(source["files"]) - MAX_LISTED
    listed += f"<li>and {more:,} more</li>" if more > 0 else ""
    read = Counter(formats.values())
    by_format = ", ".join(f"{name} {count:,}" for name, count in sorted(read.items()))
    return f"<ul>{listed}</ul>{sum(read.values()):,} file(s) read ({html.escape(by_format or 'none')})"


def _counts(source: dict[str, Any]) -> str:
    text = (
        f"{source['records']:,} accepted, {source['skipped_total']:,} rejected, of {source['lines']:,} lines"
        + (f" ({source['ignored']:,} ignored: streaming chunks before the last)" if source["ignored"] else "")
    )
    reasons = "".join(
        f"<li>{html.escape(reason)}: {count:,}</li>" for reason, count in source["skipped"].items()
    )
    examples = "".join(
        f"<li><code>{html.escape(str(e['file']))}:{e.get('line', e.get('row'))}</code> "
        f"{html.escape(e['field'] or 'line')} {html.escape(e['message'])}</li>"
        for e in source["skipped_examples"][:5]
    )
    return (
        html.escape(text)
        + (f"<br/>rejected, by reason:<ul>{reasons}</ul>" if reasons else "")
        + (f"first rejected:<ul>{examples}</ul>" if examples else "")
    )


def _cost_models(report: dict[str, Any], cost_for: Callable[[str], CostModel]) -> str:
    items = []
    for name in report["models"]:
        cost = cost_for(name)
        items.append(
            f"<li>{html.escape(name)}: C(n) = a&#183;n + b&#183;n(n+1)/2 with a = {cost.a:.4g}, "
            f"b = {cost.b:.4g}, in <b>{html.escape(cost.unit)}</b> "
            f"({html.escape(UNIT_MEANING[cost.unit])})</li>"
        )
    return f"<ul>{''.join(items)}</ul>" if items else "none (no record)"


# --- key numbers and tables ------------------------------------------------------------------


def _key_numbers(report: dict[str, Any]) -> str:
    overall = report["overall"]
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in render.summary_lines(report))
    ratios = _bars(
        "The three ratios",
        "The three ratios of all records, in percent",
        [(title, overall[key]) for key, title in render.RATIO_NAMES],
    )
    shares = _bars(
        "Share of requests and of modelled work, by group",
        "For each prompt-length group and hit status, its share of requests and of modelled work, in percent",
        [
            (f"{g['prompt_len']} {g['cache']} {kind}", g[f"share_of_{kind}"])
            for g in report["groups"]
            for kind in ("requests", "work")
        ],
    )
    return f"<ul>{summary}</ul>{ratios}{shares}"


def _tables(report: dict[str, Any]) -> str:
    group_table = html_table(render.GROUP_HEADER, render.group_rows(report))
    models = [render.model_row(name, model) for name, model in report["models"].items()]
    return (
        f"<h3>By prompt length and hit status</h3>{group_table}"
        f"<h3>By model</h3>{html_table(render.MODEL_HEADER, models)}"
    )


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f'<th scope="col">{html.escape(h)}</th>' for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def figure_html(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{caption}</figcaption></figure>"


def svg_open(width: int, height: int, label: str) -> str:
    # the viewBox keeps the proportions when the style shrinks the chart to a narrower page
    return (
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(label)}">'
        f"<title>{html.escape(label)}</title>"
    )


def _bars(title: str, label: str, items: list[tuple[str, float | None]], width: int = 640) -> str:
    """Horizontal bars of fractions in one neutral colour (blue and vermillion mean hit and miss
    here); a fraction that is not one number (work in several units) is written n/a, not 0."""
    if not items:
        return ""
    height = 24 * len(items) + 12
    rows = []
    for i, (name, value) in enumerate(items):
        y = 4 + 24 * i
        length = 1.0 if value is None else max(value * (width - 320), 1.0)
        shown = percent(value)
        bar = (
            ""
            if value is None
            else f'<rect x="200" y="{y}" width="{length:.1f}" height="18" fill="{NEUTRAL_COLOUR}"/>'
        )
        rows.append(
            f'<text x="0" y="{y + 14}" class="label">{html.escape(name)}</text>{bar}'
            f'<text x="{205 + length:.1f}" y="{y + 14}" class="value">{shown}</text>'
        )
    return figure_html(svg_open(width, height, label) + "".join(rows) + "</svg>", html.escape(title))


# --- hit beside miss -------------------------------------------------------------------------


def _latency(report: dict[str, Any]) -> str:
    charts = [_paired(report["groups"], column, name) for column, name in LATENCY_CHARTS]
    shown = "".join(chart for chart in charts if chart)
    return shown or "<p>No latency was recorded.</p>"


def legend_svg(x: int, y: int) -> str:
    return (
        f'<g class="legend" transform="translate({x},{y})">'
        + "".join(
            f'<rect x="{110 * i}" y="0" width="12" height="12" fill="{colour}"/>'
            f'<text x="{110 * i + 16}" y="11" class="label">cache {name}</text>'
            for i, (name, colour) in enumerate(SERIES)
        )
        + "</g>"
    )


def _paired(groups: list[dict[str, Any]], column: str, name: str, width: int = 680) -> str:
    """One row pair per prompt-length group: the hit bar above the miss bar, on one axis in ms;
    the bar is the median, the whisker reaches p95. A series with no request at a length says so,
    so the pair is never silently half."""
    lengths = list(dict.fromkeys(g["prompt_len"] for g in groups))
    by_key = {(g["prompt_len"], g["cache"]): g[column] for g in groups}
    values = [v[q] for v in by_key.values() for q in ("p50", "p95") if v[q] is not None]
    if not values:
        return ""
    ticks = linear_ticks(max(values))
    top = ticks[-1]
    left, right, row = 110, 150, 18
    plot = width - left - right
    height = 40 + len(lengths) * (2 * row + 14) + 34
    parts = [legend_svg(left, 6)]
    y = 30
    for length in lengths:
        parts.append(f'<g class="pair" data-length="{html.escape(length)}">')
        parts.append(
            f'<text x="{left - 8}" y="{y + row + 4}" text-anchor="end" class="label">'
            f"{html.escape(length)}</text>"
        )
        for series, colour in SERIES:
            stats = by_key.get((length, series))
            parts.append(f'<g class="series" data-series="{series}" data-fill="{colour}">')
            if stats is None or stats["p50"] is None:
                why = "no request" if stats is None else "not measured"
                parts.append(
                    f'<text x="{left + 4}" y="{y + 13}" class="value" fill="{colour}">{series}: {why}</text>'
                )
            else:
                median, p95 = stats["p50"], stats["p95"]
                bar = max(plot * median / top, 1.0)
                parts.append(
                    f'<rect x="{left}" y="{y}" width="{bar:.1f}" height="{row - 2}" fill="{colour}">'
                    f"<title>{series} {length}: p50 {render.milliseconds(median)} ms, "
                    f"p95 {render.milliseconds(p95)} ms</title></rect>"
                )
                end = left + plot * p95 / top
                parts.append(
                    f'<line x1="{left + bar:.1f}" x2="{end:.1f}" '
                    f'y1="{y + row / 2 - 1}" y2="{y + row / 2 - 1}" '
                    f'stroke="{colour}" stroke-width="2"/>'
                )
                parts.append(
                    f'<text x="{max(end, left + bar) + 6:.1f}" y="{y + 13}" class="value">'
                    f"{render.milliseconds(median)} / {render.milliseconds(p95)} ms</text>"
                )
            parts.append("</g>")
            y += row
        parts.append("</g>")
        y += 14
    parts.append(linear_axis(left, plot, y + 4, ticks))
    parts.append(
        f'<text x="{left + plot / 2}" y="{height - 2}" text-anchor="middle" class="axis-title">'
        f"{name} (ms)</text>"
    )
    label = f"{name} by prompt-length group, cache hit beside miss: median bar, p95 whisker, in milliseconds"
    caption = (
        f"{html.escape(name)}: at each prompt length (tokens), the hit bar above the miss bar; "
        "bar: median, whisker: p95 (both in ms, printed right of the bar)."
    )
    return figure_html(svg_open(width, height, label) + "".join(parts) + "</svg>", caption)


def _nice_step(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value``."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= value * (1 - 1e-12))


def linear_ticks(high: float, most: int = 5) -> list[float]:
    """Ticks from 0 at a 1-2-5 step, the last at or above ``high``, at most ``most`` steps."""
    step = _nice_step(high / most)
    return [step * i for i in range(max(math.ceil(high / step - 1e-9), 1) + 1)]


def linear_axis(left: float, length: float, y: float, ticks: list[float]) -> str:
    """A horizontal axis in ms from the first tick (0, or below it for deltas) to the last."""
    low, top = ticks[0], ticks[-1]
    marks = []
    for t in ticks:
        x = left + length * (t - low) / (top - low)
        marks.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}" class="tick"/>'
            f'<text x="{x:.1f}" y="{y + 15}" text-anchor="middle" class="value">{1000 * t:g}</text>'
        )
    return f'<line x1="{left}" x2="{left + length}" y1="{y}" y2="{y}" class="axis"/>{"".join(marks)}'


# --- calibration -----------------------------------------------------------------------------


def _calibration(fits: list[dict[str, Any]]) -> str:
    if not fits:
        return "<p>No prefill times to fit.</p>"
    return "".join(
        '<div class="fit">'
        + "".join(f"<p>{html.escape(line)}</p>" for line in render.calibration_lines(fit))
        + f"{_calibration_chart(fit)}</div>"
        for fit in fits
    )


class Axis:
    """A scale from data to pixels: logarithmic when the data spans more than :data:`LOG_SPAN`."""

    def __init__(self, values: Sequence[float], start: float, length: float, *, flip: bool = False) -> None:
        low, high = min(values), max(values)
        self.log = low > 0 and high / low > LOG_SPAN
        if self.log:
            self.low, self.high = 10 ** math.floor(math.log10(low)), 10 ** math.ceil(math.log10(high))
            self.marks = [self.low * 10**i for i in range(round(math.log10(self.high / self.low)) + 1)]
        else:
            self.marks = linear_ticks(high)
            self.low, self.high = 0.0, self.marks[-1]
        self.start, self.length, self.flip = start, length, flip

    def __call__(self, value: float) -> float:
        if self.log:
            share = math.log10(value / self.low) / math.log10(self.high / self.low)
        else:
            share = (value - self.low) / (self.high - self.low)
        return self.start + (self.length * (1 - share) if self.flip else self.length * share)

    def ticks(self) -> list[float]:
        return self.marks

    @property
    def scale(self) -> str:
        return "log" if self.log else "linear"


@dataclass(frozen=True)
class Box:
    """A chart's plotting area inside its SVG."""

    width: int = 640
    height: int = 420
    left: int = 70
    right: int = 36  # room for the last tick's label
    top: int = 30
    bottom: int = 60

    @property
    def x_end(self) -> int:
        return self.width - self.right

    @property
    def y_end(self) -> int:
        return self.height - self.bottom


def _calibration_chart(fit: dict[str, Any], box: Box = Box()) -> str:
    """Measured prefill time against prompt tokens (hits and misses in their colours) under the
    fitted curve for no cached token and, when hits were measured, at their median cached share."""
    points = [(n, h, t) for n, h, t in fit.get("sample") or [] if n > 0 and t > 0]
    a, b, c = fit["a_seconds_per_token"], fit["b_seconds_per_pair"], fit["c_seconds"]
    if not points or a == b == c == 0:
        return ""
    cost = CostModel(a=a, b=b, unit=SECONDS)
    shares = sorted(h / n for n, h, _ in points if h > 0)
    curves = [("no cached token", 0.0)]
    if shares:
        share = shares[len(shares) // 2]
        curves.append((f"{share:.0%} of the prompt cached (the hits' median)", share))
    x = Axis([float(n) for n, _, _ in points], box.left, box.x_end - box.left)
    along = _spread(min(n for n, _, _ in points), max(n for n, _, _ in points), log=x.log)
    # a log axis has no 0: a fit without constant gives t = 0 where nothing is left to compute
    lines = {
        name: [(n, t) for n in along if (t := cost.remaining_work_of(round(n), round(share * n)) + c) > 0]
        for name, share in curves
    }
    y = Axis(
        [t for _, _, t in points] + [t for line in lines.values() for _, t in line],
        box.top,
        box.y_end - box.top,
        flip=True,
    )
    parts = [_calibration_axes(x, y, box, per_layer=fit["per_layer"])]
    # the curves under the points, so every measured point stays visible
    for (name, line), dash in zip(lines.items(), ("", ' stroke-dasharray="6 4"'), strict=False):
        path = " ".join(f"{'L' if i else 'M'}{x(n):.1f},{y(t):.1f}" for i, (n, t) in enumerate(line))
        parts.append(
            f'<path class="fitted" d="{path}" fill="none" stroke="{INK}" stroke-width="1.5"{dash}>'
            f"<title>fitted, {html.escape(name)}</title></path>"
        )
    for series, colour in SERIES:
        dots = "".join(
            f'<circle cx="{x(n):.1f}" cy="{y(t):.1f}" r="2.5" fill="{colour}" fill-opacity="0.6"/>'
            for n, h, t in points
            if (h > 0) == (series == "hit")
        )
        parts.append(f'<g class="points" data-series="{series}" data-fill="{colour}">{dots}</g>')
    parts.append(_calibration_legend([name for name, _ in curves], box))
    label = (
        f"Calibration of {fit['model']}: measured prefill time in seconds against prompt length in "
        f"tokens ({x.scale} x axis, {y.scale} y axis), with the fitted curve"
    )
    sampled = f"{len(points):,} of {fit['requests']:,} {fit['source']}"
    caption = (
        f"<b>{html.escape(fit['model'])}</b>: measured prefill ({html.escape(sampled)}) and the "
        f"fitted curve. {_fit_parameters(fit)}"
    )
    return figure_html(svg_open(box.width, box.height, label) + "".join(parts) + "</svg>", caption)


def _spread(low: float, high: float, *, log: bool, steps: int = 60) -> list[float]:
    """Where to evaluate a curve from ``low`` to ``high``: evenly on the axis's scale."""
    if log:
        return [low * (high / low) ** (i / steps) for i in range(steps + 1)]
    return [low + (high - low) * i / steps for i in range(steps + 1)]


def _calibration_axes(x: Axis, y: Axis, box: Box, *, per_layer: bool) -> str:
    x_ticks = "".join(
        f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{box.y_end}" y2="{box.y_end + 4}" class="tick"/>'
        f'<text x="{x(t):.1f}" y="{box.y_end + 16}" text-anchor="middle" class="value">{tick_label(t)}</text>'
        for t in x.ticks()
    )
    y_ticks = "".join(
        f'<line x1="{box.left - 4}" x2="{box.left}" y1="{y(t):.1f}" y2="{y(t):.1f}" class="tick"/>'
        f'<text x="{box.left - 6}" y="{y(t) + 4:.1f}" text-anchor="end" class="value">{tick_label(t)}</text>'
        for t in y.ticks()
    )
    x_title = f"prompt length (tokens){', log scale' if x.log else ''}"
    # a table measured per layer, without the layer count, fits (and so shows) one layer
    y_title = f"prefill time{' per layer' if per_layer else ''} (seconds){', log scale' if y.log else ''}"
    middle_x, middle_y = (box.left + box.x_end) / 2, (box.top + box.y_end) / 2
    return (
        f'<g class="scale" data-axis="x" data-scale="{x.scale}">'
        f'<line x1="{box.left}" x2="{box.x_end}" y1="{box.y_end}" y2="{box.y_end}" class="axis"/>{x_ticks}'
        f'<text x="{middle_x}" y="{box.height - 22}" text-anchor="middle" class="axis-title">{x_title}</text>'
        f'</g><g class="scale" data-axis="y" data-scale="{y.scale}">'
        f'<line x1="{box.left}" x2="{box.left}" y1="{box.top}" y2="{box.y_end}" class="axis"/>{y_ticks}'
        f'<text transform="translate(14,{middle_y}) rotate(-90)" text-anchor="middle" '
        f'class="axis-title">{y_title}</text></g>'
    )


def _calibration_legend(curves: list[str], box: Box) -> str:
    marks = [f'<circle cx="8" cy="0" r="4" fill="{colour}"/>' for _, colour in SERIES]
    marks += [
        f'<line x1="0" x2="16" y1="0" y2="0" stroke="{INK}" stroke-width="1.5"{dash}/>'
        for _, dash in zip(curves, ("", ' stroke-dasharray="6 4"'), strict=False)
    ]
    names = ["measured, cache hit", "measured, cache miss", *(f"fitted, {name}" for name in curves)]
    rows = "".join(
        f'<g transform="translate(0,{16 * i})">{mark}'
        f'<text x="22" y="4" class="label">{html.escape(name)}</text></g>'
        for i, (mark, name) in enumerate(zip(marks, names, strict=True))
    )
    return f'<g class="legend" transform="translate({box.left + 8},{box.top + 4})">{rows}</g>'


def _fit_parameters(fit: dict[str, Any]) -> str:
    per = " per layer" if fit["per_layer"] else ""
    r2 = "n/a" if fit["r2"] is None else f"{fit['r2']:.3f}"
    error = "n/a" if fit["median_error"] is None else f"{100 * fit['median_error']:.1f} %"
    return (
        f"Fit{per}: t = a&#183;m + b&#183;(m&#183;h + m(m+1)/2) + c with m = n &#8722; h; "
        f"a = {fit['a_seconds_per_token']:.3g} s/token, b = {fit['b_seconds_per_pair']:.3g} s/pair, "
        f"c = {fit['c_seconds']:.3g} s; R&#178; {r2}, median error {error}."
    )


def tick_label(value: float) -> str:
    return f"{value:,.0f}" if value >= 1 and float(value).is_integer() else f"{value:g}"


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5rem auto;max-width:1100px;padding:0 1rem;color:#1d232a}
h1{margin:.2rem 0}h2{border-bottom:1px solid #d5dae0;padding-bottom:.2rem}
#verdict{background:#fdf7ee;border:1px solid #e8c79a;border-radius:6px;padding:.2rem 1rem .6rem}
#verdict .lead{font-weight:600}.findings li{margin:.4rem 0}
.severity{font-size:11px;font-weight:700;padding:1px 5px;border-radius:3px;color:#fff;background:#6b7785}
.warning .severity{background:#a34d00}.info .severity{background:#2d6cb3}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.3rem 1rem}dt{font-weight:600}dd{margin:0}
dd ul{margin:0;padding-left:1.2rem}code{overflow-wrap:anywhere}
table{border-collapse:collapse;margin:.5rem 0;font-size:13px}
td,th{border:1px solid #d5dae0;padding:3px 6px;text-align:right}th{background:#f1f3f5}
.scroll{overflow-x:auto}
figure{margin:1rem 0}svg{max-width:100%;height:auto;display:block}figcaption{font-size:12px;color:#3d4650}
.label,.value{font-size:12px;fill:#1d232a}.axis-title{font-size:12px;font-weight:600;fill:#1d232a}
.axis,.tick{stroke:#6b7785;stroke-width:1}
@media print{
 body{max-width:none;margin:0;padding:0;font-size:11px}
 table{font-size:9px}td,th{padding:1px 3px}.scroll{overflow:visible}
 details.data{display:none}figure,.fit,#verdict{break-inside:avoid}
}
"""
