"""``kvlens simulate`` output: the tables, the reuse-vs-capacity curve in the terminal, and the
same curve as an SVG (written here, no dependency) or a PNG (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from kvlens.errors import MissingExtra
from kvlens.terminal import NARROWEST, percent, visible, wrapped

BAR_WIDTH = 40
COLORS = ("#3b7dd8", "#d8683b", "#3bb273", "#9b59b6", "#7f8c8d", "#c0392b")


def _capacity(value: int | None) -> str:
    return "unbounded" if value is None else f"{value:,}"


WIDE_ROW = 105  # the one-line row per policy; narrower terminals get two short tables


def text(result: dict[str, Any], columns: int = NARROWEST) -> str:
    trace, fleet, reachable = result["trace"], result["fleet"], result["reachable"]
    cost = fleet["prefill_cost_model"]
    lines = wrapped(
        [
            f"trace {trace['path']} ({trace['format']}, {trace['block_size']}-token blocks): "
            f"{trace['requests']:,} requests, {trace['prompt_tokens']:,} prompt tokens"
            + (f", time x{trace['time_scale']:g}" if trace["time_scale"] != 1 else ""),
            f"fleet {fleet['replicas']} replicas, at most {fleet['max_running']} running each, "
            f"{'chunked' if fleet['chunked_prefill'] else 'unchunked'} prefill of "
            f"{cost['a']:.3g} s/token + {cost['b']:.3g} s/pair",
            f"reachable (one unbounded cache): token reuse {percent(reachable['token_reuse_ratio'], 1)}, "
            f"request hit {percent(reachable['request_hit_ratio'], 1)}, "
            f"compute saved {percent(reachable['compute_saved_ratio'], 1)}",
        ],
        columns,
    )
    for block in result["capacities"]:
        pooled = block["pooled"]
        lines += [
            "",
            f"capacity {_capacity(block['capacity_blocks'])} blocks per replica "
            f"(pooled: token reuse {percent(pooled['token_reuse_ratio'], 1)})",
        ]
        lines += _policy_rows(block["policies"], wide=columns >= WIDE_ROW)
        lines += wrapped([line for run in block["policies"] for line in _funnel_lines(run)], columns)
    if len(result["capacities"]) > 1:
        lines += ["", *curve(result)]
    return "\n".join(lines) + "\n"


def _funnel_lines(run: dict[str, Any]) -> list[str]:
    """The policy's loss funnel, as the live sidecar's recording rules give it: each stage's
    share of the prompt, in tokens and in modelled work."""
    funnel = run.get("funnel")
    if not funnel:
        return []
    stages = funnel["stages"]
    prompt = stages["prompt"]

    def share(stage: dict[str, Any], key: str) -> str:
        return percent(stage[key] / prompt[key] if prompt[key] else None, 1)

    return [
        f"{run['policy']} funnel (tokens / {funnel['unit']}): "
        + " -> ".join(
            f"{name.replace('_', ' ')} {share(stage, 'tokens')} / {share(stage, 'work')}"
            for name, stage in stages.items()
            if name != "prompt"
        )
    ]


def _policy_rows(runs: list[dict[str, Any]], *, wide: bool) -> list[str]:
    """Each policy's reuse, queueing and lost reuse, and its TTFT percentiles: on one row each
    when ``wide``, else in two tables of at most 80 columns."""

    def reuse(run: dict[str, Any]) -> str:
        return (
            f"{run['policy']:<16} {percent(run['request_hit_ratio'], 1):>8} "
            f"{percent(run['token_reuse_ratio'], 1):>8} {percent(run['compute_saved_ratio'], 1):>8}"
        )

    def ttft(run: dict[str, Any]) -> list[str]:
        return [f"{run['ttft_seconds'][p]:.2f}" for p in ("p50", "p95", "p99")]

    def rest(run: dict[str, Any]) -> str:
        gap = run.get("token_reuse_gap")
        lost = "" if gap is None else f"{100 * gap['capacity']:.1f} / {100 * gap['routing']:.1f} pts"
        return f"{percent(run['queue_share_of_ttft'], 0):>6} {run['load_imbalance']:>6.2f} {lost:>22}"

    head = f"{'policy':<16} {'req hit':>8} {'reuse':>8} {'saved':>8}"
    tail = f"{'queue':>6} {'imbal':>6} {'lost: capacity/routing':>22}"
    if wide:
        lines = [f"{head} {'TTFT p50/p95/p99 s':>22} {tail}"]
        lines += [f"{reuse(r)} {' / '.join(f'{t:>6}' for t in ttft(r))} {rest(r)}" for r in runs]
        return lines
    lines = [f"{head} {tail}", *(f"{reuse(r)} {rest(r)}" for r in runs)]
    lines.append(f"{'':<16} {'TTFT p50 s':>10} {'p95 s':>9} {'p99 s':>9}")
    lines += [f"{r['policy']:<16} {t[0]:>10} {t[1]:>9} {t[2]:>9}" for r in runs for t in [ttft(r)]]
    return lines


def _series(result: dict[str, Any]) -> dict[str, list[tuple[int | None, float]]]:
    """Token reuse per capacity: pooled and each policy."""
    series: dict[str, list[tuple[int | None, float]]] = {"pooled": []}
    for block in result["capacities"]:
        series["pooled"].append((block["capacity_blocks"], block["pooled"]["token_reuse_ratio"] or 0.0))
        for run in block["policies"]:
            series.setdefault(run["policy"], []).append(
                (block["capacity_blocks"], run["token_reuse_ratio"] or 0.0)
            )
    return series


def curve(result: dict[str, Any]) -> list[str]:
    """Token reuse vs capacity as bars, one per policy at each capacity, the reachable reuse marked."""
    reachable = result["reachable"]["token_reuse_ratio"] or 0.0
    mark = round(reachable * BAR_WIDTH)
    lines = [f"token reuse vs capacity (| marks the reachable {percent(reachable, 1)})"]
    for block in result["capacities"]:
        lines.append(f"  {_capacity(block['capacity_blocks'])} blocks per replica")
        runs = [("pooled", block["pooled"])] + [(run["policy"], run) for run in block["policies"]]
        for name, run in runs:
            filled = round((run["token_reuse_ratio"] or 0.0) * BAR_WIDTH)
            bar = "".join(
                "|" if i == mark and i >= filled else ("#" if i < filled else " ")
                for i in range(BAR_WIDTH + 1)
            )
            lines.append(f"    {name:<16} {bar} {percent(run['token_reuse_ratio'], 1)}")
    return lines


def write_plot(result: dict[str, Any], path: Path) -> None:
    """The curve as ``path``: SVG (any install) or PNG (needs matplotlib: the ``plot`` extra)."""
    suffix = path.suffix.lower()
    if suffix == ".svg":
        path.write_text(svg(result))
    elif suffix == ".png":
        _png(result, path)
    else:
        raise ValueError(f"--plot writes .svg or .png, not {path.name!r}")


def _x(capacity: int | None, finite: list[int]) -> float:
    """Capacities on a log scale; unbounded one step past the largest."""
    if capacity is None:
        return math.log10(max(finite)) + 1 if finite else 1.0
    return math.log10(max(capacity, 1))


def svg(result: dict[str, Any], width: int = 640, height: int = 360) -> str:
    series = _series(result)
    finite = [c for c, _ in series["pooled"] if c is not None]
    xs = [_x(c, finite) for c, _ in series["pooled"]]
    low, high = min(xs), max(xs)
    span = (high - low) or 1.0
    left, right, top, bottom = 60, width - 150, 30, height - 40

    def at(capacity: int | None, reuse: float) -> tuple[float, float]:
        return (
            left + (_x(capacity, finite) - low) / span * (right - left),
            bottom - reuse * (bottom - top),
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="18" font-weight="600">Token reuse vs cache capacity per replica</text>',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#888"/>',
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = bottom - tick * (bottom - top)
        parts.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{100 * tick:.0f} %</text>')
    for capacity, _ in series["pooled"]:
        x, _y = at(capacity, 0.0)
        parts.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_capacity(capacity)}</text>')
    reachable = result["reachable"]["token_reuse_ratio"] or 0.0
    y = bottom - reachable * (bottom - top)
    parts.append(
        f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#000" stroke-dasharray="4"/>'
        f'<text x="{right + 6}" y="{y + 4:.1f}">reachable</text>'
    )
    for index, (name, points) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        coordinates = " ".join(f"{x:.1f},{y:.1f}" for x, y in (at(c, r) for c, r in points))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coordinates}"/>')
        for c, r in points:
            x, y = at(c, r)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
        parts.append(
            f'<text x="{right + 6}" y="{top + 16 * index + 20}" fill="{color}">{svg_text(name)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def svg_text(name: str) -> str:
    """A name in an SVG we write, as written: XML's markup escaped, and a control character (which
    XML refuses: the file would not parse) shown as its escape."""
    return html.escape(visible(name))


def plot_label(name: str) -> str:
    """A name as a matplotlib label showing it as written: matplotlib reads text between two
    ``$`` as mathtext (``a$b$c`` drew an italic b; ``p$\\q$`` raised ValueError at draw time, so
    ``--plot`` crashed after the run), and draws a control character as a missing glyph. Each
    ``$`` escaped (``\\$`` is a dollar in plain text; a backslash elsewhere is text) and control
    characters shown as their escapes. Every name the plots draw goes through here."""
    return visible(name).replace("$", r"\$")


def legend(axes: Any, **options: Any) -> None:
    """A legend of every line on ``axes`` under its label: matplotlib's own choice leaves out a
    line whose label starts with ``_`` (an endpoint ``_b`` was missing from it)."""
    lines = axes.get_lines()
    axes.legend(lines, [line.get_label() for line in lines], **options)


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (no display), or :class:`MissingExtra` (the plot extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise MissingExtra("a PNG (an SVG needs nothing)", "plot") from None
    return plt


def _png(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    series = _series(result)
    finite = [c for c, _ in series["pooled"] if c is not None]
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        axes.plot(
            [_x(c, finite) for c, _ in points],
            [100 * r for _, r in points],
            marker="o",
            label=plot_label(name),
        )
    axes.axhline(
        100 * (result["reachable"]["token_reuse_ratio"] or 0.0),
        color="black",
        linestyle="--",
        label="reachable",
    )
    axes.set_xticks([_x(c, finite) for c, _ in series["pooled"]], [_capacity(c) for c, _ in series["pooled"]])
    axes.set_xlabel("cache capacity per replica (blocks)")
    axes.set_ylabel("token reuse (%)")
    axes.set_ylim(0, 100)
    legend(axes, fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
