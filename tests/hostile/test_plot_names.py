"""Names in the plots (``kvlens experiment quantization --plot``'s endpoints, ``kvlens simulate
--plot``'s series) drawn as written. matplotlib reads ``$...$`` in a label as mathtext: ``p$\\q$``
raised ValueError (ParseFatalException: Unknown symbol) at draw time, so --plot crashed after the
experiment had run, and ``a$b$c`` drew an italic b without its dollars; a label starting with
``_`` was left out of the legend; a control character drew a missing glyph (or broke the SVG's
XML)."""

from __future__ import annotations

import io
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from kvlens.experiment import plot
from kvlens.simulate import render
from kvlens.terminal import visible

pytest.importorskip("matplotlib")

NAMES = ["a$b$c", "$x", "p$\\q$", "x$^$", "back\\slash$", "_hidden", "n\nq", "c\x1bd"]
SVG = "{http://www.w3.org/2000/svg}"


def quantization_result(name: str) -> dict[str, Any]:
    steps = {name: [(1.0, 1.0), (2.0, 0.5)], "base": [(1.0, 1.0), (2.0, 0.9)]}
    return {
        "targets": {"attainment": 0.9},
        "rising_load": {"steps": {n: [{"rate": r, "attainment": a} for r, a in s] for n, s in steps.items()}},
    }


def simulate_result(name: str) -> dict[str, Any]:
    return {
        "reachable": {"token_reuse_ratio": 0.5},
        "capacities": [
            {
                "capacity_blocks": capacity,
                "pooled": {"token_reuse_ratio": 0.4},
                "policies": [
                    {"policy": name, "token_reuse_ratio": 0.3},
                    {"policy": "base", "token_reuse_ratio": 0.2},
                ],
            }
            for capacity in (16, None)
        ],
    }


def texts_drawn(figure: Any) -> list[str]:
    """What the figure shows as text: drawn to an SVG whose text stays text (mathtext would
    split a label into pieces), each <text> element's string."""
    import matplotlib

    out = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(out, format="svg")
    return ["".join(t.itertext()) for t in ET.fromstring(out.getvalue()).iter(f"{SVG}text")]


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the plots draw, kept when they close them."""
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("write", "result_of"),
    [(plot.write_plot, quantization_result), (render.write_plot, simulate_result)],
    ids=["quantization", "simulate"],
)
def test_a_png_draws_the_name_as_written_in_its_legend(
    name: str, write: Any, result_of: Any, tmp_path: Path, drawn: list[Any]
) -> None:
    path = tmp_path / "plot.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing glyph is a warning
        write(result_of(name), path)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    (figure,) = drawn
    texts = texts_drawn(figure)
    assert visible(name) in texts, texts
    assert "base" in texts


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("write", "result_of"),
    [(plot.write_plot, quantization_result), (render.write_plot, simulate_result)],
    ids=["quantization", "simulate"],
)
def test_an_svg_is_xml_showing_the_name_as_written(
    name: str, write: Any, result_of: Any, tmp_path: Path
) -> None:
    path = tmp_path / "plot.svg"
    write(result_of(name), path)
    texts = ["".join(t.itertext()) for t in ET.parse(path).iter(f"{SVG}text")]
    assert visible(name) in texts, texts
