"""Render an analyze report: terminal tables (rich), Markdown, or one self-contained HTML file
with inline SVG charts (no script, no CDN: it opens offline)."""

from __future__ import annotations

import html
import json
from typing import Any

RATIO_NAMES = (
    ("request_hit_ratio", "Request hit ratio"),
    ("token_reuse_ratio", "Token reuse ratio"),
    ("compute_saved_ratio", "Compute saved (modelled)"),
)


def _pct(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f} %"


def _ratio(key: str, value: float | None) -> str:
    """Compute saved is small by nature: one more digit."""
    return _pct(value, 3 if key == "compute_saved_ratio" else 2)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{1000 * value:.1f}"


STAGES = (("ttft_seconds", "TTFT"), ("queue_seconds", "queue"), ("prefill_seconds", "prefill"))
PERCENTILES = ("p50", "p95", "p99")


def _share_cells(group: dict[str, Any]) -> list[str]:
    return [
        group["prompt_len"],
        group["cache"],
        f"{group['requests']:,}",
        _pct(group["share_of_requests"], 1),
        _pct(group["share_of_tokens"], 1),
        _pct(group["share_of_work"], 1),
    ]


def _group_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per group, its percentiles as ``p50 / p95 / p99`` in one cell per stage."""
    return [
        [
            *_share_cells(group),
            *(" / ".join(_ms(group[stage][p]) for p in PERCENTILES) for stage, _ in STAGES),
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


def _model_row(name: str, model: dict[str, Any]) -> list[str]:
    return [
        name,
        f"{model['requests']:,}",
        _ratio("request_hit_ratio", model["request_hit_ratio"]),
        _ratio("token_reuse_ratio", model["token_reuse_ratio"]),
        _compute_saved(model),
    ]


MODEL_HEADER = ["model", "requests", "request hit", "token reuse", "compute saved (unit)"]


def _has_records(report: dict[str, Any]) -> bool:
    return bool(report["input"]["files"])


def _summary_lines(report: dict[str, Any]) -> list[str]:
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
                f"{name} {_pct(decomposition[f'{name}_share'], 1)}" for name in ("queue", "prefill", "other")
            )
        )
    slowest = report["slowest"]
    if slowest["requests"]:
        where = ", ".join(
            f"{g['prompt_len']} {g['cache']} {_pct(g['share'], 0)}" for g in slowest["groups"][:4]
        )
        lines.append(f"Slowest 5 % (TTFT >= {_ms(slowest['threshold_seconds'])} ms): {where}")
    return lines


def terminal(report: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    if _has_records(report):
        _terminal_records(console, report)
    for fit in report["calibration"]:
        for line in _calibration_lines(fit):
            console.print(line)


def _terminal_records(console: Any, report: dict[str, Any]) -> None:
    for line in _summary_lines(report):
        console.print(line)
    for table in _group_tables(console, report):
        console.print(table)
    models = _table("By model", MODEL_HEADER)
    for name, model in report["models"].items():
        models.add_row(*_model_row(name, model))
    console.print(models)
    for item in report["diagnosis"]:
        console.print(f"[bold]{item['severity'].upper()}[/bold] {item['title']}\n  {item['detail']}")
    for example in report["input"]["skipped_examples"][:5]:
        console.print(
            f"skipped {example['file']}:{example['line']}: {example['field'] or 'line'} {example['message']}",
            markup=False,
        )


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
        wide.add_row(*_share_cells(group), *(_ms(group[s][p]) for s, _ in STAGES for p in PERCENTILES))
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
            latency.add_row(*label, name, *(_ms(group[stage][p]) for p in PERCENTILES), end_section=i == 2)
    return [shares, latency]


def _calibration_lines(fit: dict[str, Any]) -> list[str]:
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
    if _has_records(report):
        out += _markdown_records(report)
    if report["calibration"]:
        out += ["## Calibration", ""]
        out += [f"- {line.strip()}" for fit in report["calibration"] for line in _calibration_lines(fit)]
    return "\n".join(out) + "\n"


def _markdown_records(report: dict[str, Any]) -> list[str]:
    out = [f"- {line}" for line in _summary_lines(report)]
    out += ["", "## By prompt length and hit status", "", _md_table(GROUP_HEADER, _group_rows(report)), ""]
    out += ["## By model", ""]
    model_rows = [_model_row(name, m) for name, m in report["models"].items()]
    out += [_md_table(MODEL_HEADER, model_rows), ""]
    out += ["## Diagnosis", ""]
    out += [f"- **{d['severity']}** {d['title']}: {d['detail']}" for d in report["diagnosis"]] or [
        "- nothing found"
    ]
    return [*out, ""]


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _svg_bars(title: str, items: list[tuple[str, float]], unit: str = "%", width: int = 640) -> str:
    """A horizontal bar chart; values are fractions (unit %) or seconds (unit ms)."""
    if not items:
        return ""
    height = 24 * len(items) + 36
    top = max((v for _, v in items), default=0) or 1.0
    bars = []
    for i, (label, value) in enumerate(items):
        y = 28 + 24 * i
        length = 0 if unit == "%" and value <= 0 else (value / (1.0 if unit == "%" else top)) * (width - 320)
        shown = f"{100 * value:.2f} %" if unit == "%" else f"{1000 * value:.1f} ms"
        bars.append(
            f'<text x="0" y="{y + 14}" class="label">{html.escape(label)}</text>'
            f'<rect x="200" y="{y}" width="{max(length, 1):.1f}" height="18" class="bar"/>'
            f'<text x="{205 + max(length, 1):.1f}" y="{y + 14}" class="value">{shown}</text>'
        )
    return (
        f'<figure><svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(title)}"><text x="0" y="16" class="title">{html.escape(title)}</text>'
        + "".join(bars)
        + "</svg></figure>"
    )


def _svg_scatter(fit: dict[str, Any], size: int = 360) -> str:
    points = fit.get("residuals") or []
    if not points:
        return ""
    top = max(max(p, m) for p, m in points) or 1.0
    scale = (size - 40) / top
    dots = "".join(
        f'<circle cx="{30 + p * scale:.1f}" cy="{size - 30 - m * scale:.1f}" r="2" class="dot"/>'
        for p, m in points
    )
    return (
        f'<figure><svg viewBox="0 0 {size} {size}" width="{size}" height="{size}" role="img" '
        f'aria-label="Calibration residuals {html.escape(fit["model"])}">'
        f'<text x="0" y="14" class="title">{html.escape(fit["model"])}: measured vs modelled prefill</text>'
        f'<line x1="30" y1="{size - 30}" x2="{size - 10}" y2="{size - 30 - (size - 40)}" class="diagonal"/>'
        f"{dots}</svg><figcaption>x: modelled, y: measured prefill; R^2 "
        f"{'n/a' if fit['r2'] is None else round(fit['r2'], 3)}</figcaption></figure>"
    )


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:1100px;color:#1d232a}
table{border-collapse:collapse;margin:1rem 0}td,th{border:1px solid #d5dae0;padding:4px 8px;text-align:right}
th{background:#f1f3f5}.title{font-weight:600}.bar{fill:#3b7dd8}.dot{fill:#d8683b;opacity:.6}
.diagonal{stroke:#888;stroke-dasharray:4}.label,.value{font-size:12px}.warning{color:#b35c00}.info{color:#2d6cb3}
"""


def html_page(report: dict[str, Any]) -> str:
    overall = report["overall"]
    charts = [
        _svg_bars("The three ratios", [(title, overall[key] or 0.0) for key, title in RATIO_NAMES]),
        _svg_bars(
            "Share of requests vs share of modelled work, by group",
            [
                (f"{g['prompt_len']} {g['cache']} {kind}", g[f"share_of_{kind}"] or 0.0)
                for g in report["groups"]
                for kind in ("requests", "work")
            ],
        ),
        _svg_bars(
            "TTFT p95 by group",
            [
                (f"{g['prompt_len']} {g['cache']}", g["ttft_seconds"]["p95"])
                for g in report["groups"]
                if g["ttft_seconds"]["p95"] is not None
            ],
            unit="ms",
        ),
    ]
    findings = "".join(
        f'<li class="{html.escape(d["severity"])}"><b>{html.escape(d["title"])}</b><br>'
        f"{html.escape(d['detail'])}</li>"
        for d in report["diagnosis"]
    )
    group_table = _html_table(GROUP_HEADER, _group_rows(report))
    model_table = _html_table(MODEL_HEADER, [_model_row(n, m) for n, m in report["models"].items()])
    calibration = "".join(
        "".join(f"<p>{html.escape(line)}</p>" for line in _calibration_lines(fit)) + _svg_scatter(fit)
        for fit in report["calibration"]
    )
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in _summary_lines(report))
    data = html.escape(json.dumps({k: v for k, v in report.items() if k != "calibration"}))
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        "<meta name=viewport content='width=device-width,initial-scale=1'><title>kvlens analyze</title>"
        f"<style>{STYLE}</style></head><body><h1>kvlens analyze</h1><ul>{summary}</ul>{''.join(charts)}"
        f"<h2>By prompt length and hit status</h2>{group_table}<h2>By model</h2>{model_table}"
        f"<h2>Diagnosis</h2><ul>{findings or '<li>nothing found</li>'}</ul>"
        f"<h2>Calibration</h2>{calibration or '<p>no prefill times to fit</p>'}"
        f'<details><summary>Report data (JSON)</summary><pre id="report-data">{data}</pre></details>'
        "</body></html>\n"
    )


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
