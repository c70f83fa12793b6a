"""The HTML report of ``kvlens analyze --html``, as written by the command and parsed back: the
verdict and its context first, hit beside miss at each prompt length in two colours, the
calibration chart with labelled axes in units (log scale past a decade), nothing fetched."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import orjson
import yaml

from kvlens.cli import main
from tests.article import article_records

VOID = {"meta", "br", "hr", "img", "link", "input", "source", "col", "area", "base", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    text: str = ""

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            yield from child.walk()

    def find(self, tag: str | None = None, **attrs: str) -> list[Node]:
        return [
            node
            for node in self.walk()
            if (tag is None or node.tag == tag) and all(node.attrs.get(k) == v for k, v in attrs.items())
        ]

    def all_text(self) -> str:
        return self.text + "".join(child.all_text() for child in self.children)


class TreeBuilder(HTMLParser):
    """A document tree from the standard library's tokenizer (the report has no unclosed tags:
    a mismatch fails the test)."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(Node("#text", {}, text=data))


def parse(page: str) -> Node:
    builder = TreeBuilder()
    builder.feed(page)
    builder.close()
    assert builder.stack == [builder.root], "unclosed elements"
    return builder.root


def write_records(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def html_of(tmp_path: Path, records: list[dict[str, Any]], *extra: str) -> tuple[str, Node]:
    source = write_records(tmp_path / "records.jsonl", records)
    out = tmp_path / "report.html"
    assert main(["analyze", str(source), "--html", str(out), *extra]) == 0
    page = out.read_text()
    return page, parse(page)


A, B, C = 2e-5, 2e-9, 0.004  # seconds per token, per causal pair, per forward


def prefill(n: int, h: int) -> float:
    m = n - h
    return A * m + B * (m * h + m * (m + 1) / 2) + C


def timed_traffic(lengths: list[int], start: float = 1_800_000_000.0) -> list[dict[str, Any]]:
    """Misses and half-cached hits at each length, prefill times from a known model, one arrival
    a minute; two lines a validator rejects."""
    records: list[dict[str, Any]] = []
    for i, n in enumerate(lengths * 4):
        h = (n // 2) if (i // len(lengths)) % 2 else 0  # each length: two rounds of misses, two of hits
        t = prefill(n, h)
        records.append(
            {
                "model": "m",
                "prompt_tokens": n,
                "cached_tokens": h,
                "prefill_seconds": t,
                "queue_seconds": 0.01,
                "ttft_seconds": t + 0.012,
                "arrival_time": start + 60 * i,
            }
        )
    return records


def test_verdict_then_context_precede_every_chart_and_table(tmp_path: Path) -> None:
    records = article_records()
    for i, record in enumerate(records):
        record["arrival_time"] = 1_800_000_000.0 + 36 * i  # 2027-01-15 08:00:00 UTC, 100 in 59.4 min
    source = write_records(tmp_path / "records.jsonl", records)
    with source.open("ab") as handle:
        handle.write(b'{"prompt_tokens": 10, "cached_tokens": 20}\nnot json\n')
    out = tmp_path / "report.html"
    assert main(["analyze", str(source), "--html", str(out)]) == 0
    tree = parse(out.read_text())
    body = tree.find("body")[0]
    order = [
        node.attrs.get("id") or node.tag for node in body.walk() if node.tag in ("section", "table", "svg")
    ]
    assert order[:2] == ["verdict", "context"], order
    verdict = tree.find("section", id="verdict")[0]
    # the findings in the diagnosis's order (DESIGN section 6: reuse, prefill, queueing, the ratio)
    assert [li.attrs["data-finding"] for li in verdict.find("li")] == ["little_reuse", "hit_ratio_flatters"]
    assert "2 findings" in verdict.all_text()
    context = tree.find("section", id="context")[0].all_text()
    assert (
        "2027-01-15 08:00:00 UTC to 2027-01-15 08:59:24 UTC (59.4 min; 100 records with an arrival_time)"
        in context
    )
    assert f"{source} (kvlens)1 file(s) read (kvlens 1)" in context
    assert "100 accepted, 2 rejected, of 102 lines" in context
    assert "a = 1, b = 0.0009766, in work_units" in context
    assert tree.find("title")[0].all_text() == "kvlens analyze: 2 findings"


def test_hit_and_miss_are_paired_per_length_in_two_colours(tmp_path: Path) -> None:
    untimed_long = {"model": "m", "prompt_tokens": 20000, "cached_tokens": 0, "ttft_seconds": 2.0}
    _, tree = html_of(tmp_path, [*timed_traffic([300, 1000, 3000]), untimed_long])
    latency = tree.find("section", id="latency")[0]
    charts = latency.find("svg")
    assert [svg.attrs["aria-label"].split(" by ")[0] for svg in charts] == [
        "Time to first token",
        "Queue time",
        "Prefill time",
    ]
    colours = set()
    for svg in charts:
        pairs = svg.find("g", **{"class": "pair"})
        assert [p.attrs["data-length"] for p in pairs] == ["0-511", "512-2047", "2048-8191", "8192-32767"]
        for pair in pairs:
            series = pair.find("g", **{"class": "series"})
            assert [s.attrs["data-series"] for s in series] == ["hit", "miss"]
            for s in series:
                colours.add((s.attrs["data-series"], s.attrs["data-fill"]))
                drawn = s.find("rect")
                if drawn:
                    assert drawn[0].attrs["fill"] == s.attrs["data-fill"]
    assert len(colours) == 2 and len({fill for _, fill in colours}) == 2
    ttft = charts[0]
    longest = ttft.find("g", **{"data-length": "8192-32767"})[0]
    hit, miss = longest.find("g", **{"class": "series"})
    assert hit.find("rect") == [] and "hit: no request" in hit.all_text()
    assert "2000.0 / 2000.0 ms" in miss.all_text()
    # the queue chart: measured for the timed lengths only
    queue_longest = charts[1].find("g", **{"data-length": "8192-32767"})[0]
    assert "miss: not measured" in queue_longest.all_text()
    legend = ttft.find("g", **{"class": "legend"})[0]
    assert [r.attrs["fill"] for r in legend.find("rect")] == [dict(colours)["hit"], dict(colours)["miss"]]
    assert [t.all_text() for t in legend.find("text")] == ["cache hit", "cache miss"]
    assert "Time to first token (ms)" in ttft.all_text()


def calibration_chart(tree: Node) -> Node:
    (svg,) = tree.find("section", id="calibration")[0].find("svg")
    return svg


def test_calibration_axes_have_units_and_log_scale_past_a_decade(tmp_path: Path) -> None:
    _, tree = html_of(tmp_path, timed_traffic([100, 300, 1000, 3000, 10000, 30000]))
    svg = calibration_chart(tree)
    x, y = svg.find("g", **{"data-axis": "x"})[0], svg.find("g", **{"data-axis": "y"})[0]
    assert x.attrs["data-scale"] == "log" and y.attrs["data-scale"] == "log"
    assert "prompt length (tokens), log scale" in x.all_text()
    assert "prefill time (seconds), log scale" in y.all_text()
    # decade ticks around 100 to 30,000 tokens
    assert [t.all_text() for t in x.find("text")][:-1] == ["100", "1,000", "10,000", "100,000"]
    hits = svg.find("g", **{"data-series": "hit"})[0].find("circle")
    misses = svg.find("g", **{"data-series": "miss"})[0].find("circle")
    assert (len(hits), len(misses)) == (12, 12)
    assert {c.attrs["fill"] for c in hits} != {c.attrs["fill"] for c in misses}
    curves = svg.find("path", **{"class": "fitted"})
    assert [c.all_text() for c in curves] == [
        "fitted, no cached token",
        "fitted, 50% of the prompt cached (the hits' median)",
    ]
    caption = tree.find("section", id="calibration")[0].find("figcaption")[0].all_text()
    # the fit finds the model the times were made from
    assert "a = 2e-05 s/token, b = 2e-09 s/pair, c = 0.004 s; R² 1.000, median error 0.0 %." in caption


def test_calibration_axes_stay_linear_within_a_decade(tmp_path: Path) -> None:
    _, tree = html_of(tmp_path, timed_traffic([2000, 2500, 3000, 4000, 5000, 6000]))
    svg = calibration_chart(tree)
    x, y = svg.find("g", **{"data-axis": "x"})[0], svg.find("g", **{"data-axis": "y"})[0]
    assert (x.attrs["data-scale"], y.attrs["data-scale"]) == ("linear", "linear")
    assert "prompt length (tokens)" in x.all_text() and "log" not in x.all_text()
    assert "prefill time (seconds)" in y.all_text() and "log" not in y.all_text()
    assert [t.all_text() for t in x.find("text")][:-1] == ["0", "2,000", "4,000", "6,000"]


def test_self_contained_and_accessible(tmp_path: Path) -> None:
    page, tree = html_of(tmp_path, timed_traffic([100, 300, 1000, 3000, 10000, 30000]))
    for node in tree.walk():
        for name in ("src", "href"):
            assert not re.match(r"\s*(https?:)?//", node.attrs.get(name, "")), (node.tag, node.attrs)
    assert tree.find("script") == [] and tree.find("link") == [] and "@import" not in page
    assert tree.find("html")[0].attrs["lang"] == "en"
    assert tree.find("title")[0].all_text() == "kvlens analyze: 0 findings"
    assert tree.find("section", id="verdict")[0].all_text().startswith("VerdictNo finding. Checked, in")
    svgs = tree.find("svg")
    assert len(svgs) == 6  # ratios, shares, TTFT, queue, prefill, calibration
    for svg in svgs:
        assert svg.attrs["role"] == "img" and svg.attrs["aria-label"]
        assert svg.children[0].tag == "title" and svg.children[0].all_text() == svg.attrs["aria-label"]
    style = tree.find("style")[0].all_text()
    assert "@media print" in style and "svg{max-width:100%" in style


def test_points_only_report_says_there_is_no_record_and_charts_each_shape(tmp_path: Path) -> None:
    points = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "prefill_h200.csv"
    out = tmp_path / "report.html"
    assert main(["analyze", "--prefill-points", str(points), "--html", str(out)]) == 0
    tree = parse(out.read_text())
    assert tree.find("section", id="verdict")[0].find("p")[0].all_text() == (
        "No record accepted, nothing to judge: only the calibration below."
    )
    context = tree.find("section", id="context")[0].all_text()
    assert "none (calibration points only)" in context and "0 accepted, 0 rejected, of 0 lines" in context
    assert tree.find("section", id="latency") == [] and tree.find("table") == []
    shapes = {line.split(",")[0] for line in points.read_text().splitlines()[1:]}
    charts = tree.find("section", id="calibration")[0].find("svg")
    assert len(charts) == len(shapes) == 2
    for svg in charts:
        assert "prompt length (tokens), log scale" in svg.all_text()
        assert "prefill time per layer (seconds), log scale" in svg.all_text()  # no layer count given
    captions = [c.all_text() for c in tree.find("section", id="calibration")[0].find("figcaption")]
    assert all("Fit per layer: t = a·m" in caption for caption in captions)


def test_past_twenty_input_paths_the_rest_are_counted(tmp_path: Path) -> None:
    paths = [
        str(write_records(tmp_path / f"part-{i:02}.jsonl", [{"prompt_tokens": 100, "cached_tokens": 16}]))
        for i in range(22)
    ]
    out = tmp_path / "report.html"
    assert main(["analyze", *paths, "--html", str(out)]) == 0
    files = parse(out.read_text()).find("section", id="context")[0].find("dd")[1]
    assert [li.all_text() for li in files.find("li")] == [
        *(f"{path} (kvlens)" for path in paths[:20]),
        "and 2 more",
    ]
    assert files.all_text().endswith("22 file(s) read (kvlens 22)")


def test_work_in_two_units_is_not_a_share_and_each_model_names_its_unit(tmp_path: Path) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text(yaml.safe_dump({"cost_models": {"fitted": {"a": 3e-5, "b": 2e-9, "unit": "seconds"}}}))
    records = [
        {"model": "fitted", "prompt_tokens": 1000, "cached_tokens": 500},
        {"model": "plain", "prompt_tokens": 1000, "cached_tokens": 0},
    ]
    _, tree = html_of(tmp_path, records, "--config", str(config))
    context = tree.find("section", id="context")[0].all_text()
    assert "fitted: C(n) = a·n + b·n(n+1)/2 with a = 3e-05, b = 2e-09, in seconds" in context
    assert "plain: C(n) = a·n + b·n(n+1)/2 with a = 1, b = 0.0009766, in work_units" in context
    ratios, shares = tree.find("section", id="numbers")[0].find("svg")
    texts = [t.all_text() for t in ratios.find("text")]
    assert texts[-2:] == ["Compute saved (modelled)", "n/a"]  # no one number across units
    assert [t.all_text() for t in shares.find("text")][-2:] == ["512-2047 miss work", "n/a"]
