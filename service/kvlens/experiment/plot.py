"""``kvlens experiment quantization --plot``: attainment against request rate, one series per
endpoint, the target attainment as a dashed line. SVG is written here (no dependency), PNG with
matplotlib (the ``plot`` extra), as ``kvlens simulate --plot`` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvlens.analysis.html_report import Axis, Box, tick_label
from kvlens.experiment.protocol import ExperimentError
from kvlens.simulate.render import COLORS, legend, plot_label, pyplot, svg_text

TITLE = "Attainment against request rate"
BOX = Box(width=640, height=380, right=150)  # room right of the plot for the endpoints' names


def series(result: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Per endpoint, its (rate, attainment) points in rate order."""
    load = result.get("rising_load")
    if not load:
        raise ValueError("--plot needs experiment 2: give --rates or --rate-sweep")
    return {
        name: sorted((float(s["rate"]), float(s["attainment"])) for s in steps)
        for name, steps in load["steps"].items()
    }


def check_path(path: Path) -> None:
    """Refuse a plot path of another kind before the experiment runs, not after."""
    if path.suffix.lower() not in (".svg", ".png"):
        raise ExperimentError(f"--plot writes .svg or .png, not {path.name!r}")


def write_plot(result: dict[str, Any], path: Path) -> None:
    check_path(path)
    if path.suffix.lower() == ".svg":
        path.write_text(svg(result))
    else:
        _png(result, path)


def svg(result: dict[str, Any], box: Box = BOX) -> str:
    """Rates on a log axis past a decade (doubling sweeps), else linear; attainment 0 to 100 %."""
    points = series(result)
    rates = [rate for line in points.values() for rate, _ in line]
    x = Axis(rates, box.left, box.x_end - box.left)
    target = float(result["targets"]["attainment"])

    def y(share: float) -> float:
        return box.y_end - share * (box.y_end - box.top)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {box.width} {box.height}" width="{box.width}" '
        f'height="{box.height}" font-family="sans-serif" font-size="12" role="img" '
        f'aria-label="{TITLE} per endpoint, with the target attainment">',
        f"<title>{TITLE}</title>",
        f'<text x="{box.left}" y="18" font-weight="600">{TITLE}</text>',
        f'<line x1="{box.left}" y1="{box.y_end}" x2="{box.x_end}" y2="{box.y_end}" stroke="#888"/>',
        f'<line x1="{box.left}" y1="{box.top}" x2="{box.left}" y2="{box.y_end}" stroke="#888"/>',
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts.append(
            f'<text x="{box.left - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{100 * tick:.0f} %</text>'
        )
    for tick in x.ticks():
        parts.append(
            f'<text x="{x(tick):.1f}" y="{box.y_end + 16}" text-anchor="middle">{tick_label(tick)}</text>'
        )
    parts.append(
        f'<text x="{(box.left + box.x_end) / 2}" y="{box.height - 20}" text-anchor="middle">'
        f"request rate (req/s){', log scale' if x.log else ''}</text>"
        f'<line class="target" x1="{box.left}" y1="{y(target):.1f}" x2="{box.x_end}" y2="{y(target):.1f}" '
        f'stroke="#000" stroke-dasharray="4"/>'
        f'<text x="{box.x_end + 6}" y="{y(target) + 4:.1f}">target {100 * target:g} %</text>'
    )
    for index, (name, line) in enumerate(points.items()):
        colour = COLORS[index % len(COLORS)]
        coordinates = " ".join(f"{x(rate):.1f},{y(share):.1f}" for rate, share in line)
        dots = "".join(
            f'<circle cx="{x(rate):.1f}" cy="{y(share):.1f}" r="3" fill="{colour}" '
            f'data-rate="{rate:g}" data-attainment="{share:g}"/>'
            for rate, share in line
        )
        parts.append(
            f'<g class="series" data-endpoint="{svg_text(name)}">'
            f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coordinates}"/>{dots}'
            # the names at the foot of the right margin: the target's label is near the top
            f'<text x="{box.x_end + 6}" y="{box.y_end - 16 * (len(points) - 1 - index)}" fill="{colour}">'
            f"{svg_text(name)}</text></g>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _png(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    points = series(result)
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, line in points.items():
        axes.plot([r for r, _ in line], [100 * a for _, a in line], marker="o", label=plot_label(name))
    rates = [rate for line in points.values() for rate, _ in line]
    if max(rates) / min(rates) > 10:
        axes.set_xscale("log")
    axes.axhline(100 * float(result["targets"]["attainment"]), color="black", linestyle="--", label="target")
    axes.set_xlabel("request rate (req/s)")
    axes.set_ylabel("attainment (%)")
    axes.set_ylim(0, 100)
    axes.set_title(TITLE)
    legend(axes)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
