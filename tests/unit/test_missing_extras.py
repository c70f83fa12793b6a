"""An extra that is missing is said one way: every place raises (or prints) errors.MissingExtra,
whose message is "WHAT needs the EXTRA extra: " and errors.install_hint's two install forms."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from kvlens.errors import MissingExtra, install_hint

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "kvlens"
# the wording of a missing extra spelled by hand: an install command, the hint composed again
HAND_SPELLED = re.compile(r"pip install '|install_hint\(|needs the [\w-]+ extra")


def test_only_errors_spells_a_missing_extra() -> None:
    spelled = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "errors.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if HAND_SPELLED.search(line)
    ]
    assert spelled == []


def hint(what: str, extra: str) -> str:
    return f"{what} needs the {extra} extra: {install_hint(extra)}"


def test_a_png_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlens.simulate import render

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra) as raised:
        render.pyplot()
    assert (raised.value.extra, str(raised.value)) == ("plot", hint("a PNG (an SVG needs nothing)", "plot"))


def test_kv_events_of_simulate_serve_without_pyzmq(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlens.simulate.serve.main import kv_event_publishers

    monkeypatch.setitem(sys.modules, "zmq", None)
    monkeypatch.delitem(sys.modules, "kvlens.fleet.publisher", raising=False)
    with pytest.raises(MissingExtra) as raised:
        kv_event_publishers("tcp://127.0.0.1:5557", 2)
    assert (raised.value.extra, str(raised.value)) == ("kv-events", hint("--kv-events", "kv-events"))


def test_the_duckdb_engine_without_duckdb(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlens.analysis.duckdb.engine import duckdb_module

    monkeypatch.setitem(sys.modules, "duckdb", None)
    with pytest.raises(MissingExtra) as raised:
        duckdb_module()
    assert (raised.value.extra, str(raised.value)) == ("scale", hint("the duckdb engine", "scale"))


def test_a_tokenizer_without_tokenizers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvlens.simulate.serve.tokenizer import HuggingFace

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingExtra) as raised:
        HuggingFace.load(tmp_path)
    assert (raised.value.extra, str(raised.value)) == ("tokenizer", hint("--tokenizer", "tokenizer"))
