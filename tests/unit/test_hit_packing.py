"""A (group, hit) pair packed into one integer is packed one way, by kvlens.reduce.pack_hit (and
its SQL, reduce_sql.pack_hit_sql): the exporter's groups, the report's cells and the DuckDB
engine's order statistics all number their groups with it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvlens import reduce
from kvlens.reduce import pack_hit, unpack_hit
from kvlens.reduce_sql import pack_hit_sql

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "kvlens"
# "x * 2 + hit", "divmod(code, 2)", "g // 2 - 1, bool(g % 2)": the packing spelled by hand; and
# its size: "groups // 2" prefixes of a numbering, "group_labels(row * 2)" a prefix's miss code,
# "[1::2]" its hit codes
BY_HAND = re.compile(
    r"\* 2 \+ [\w.]*hit|\* 2 \+ CAST\(hit|divmod\([\w.]+, 2\)|// 2 - 1"
    r"|groups // 2|group_labels\([\w.]+ \* 2\)|\[1::(?:2|HIT_STRIDE)\]|\* HIT_STRIDE\b"
)


def test_a_numbering_of_prefixes_has_a_miss_and_a_hit_code_each() -> None:
    assert reduce.codes_of(5) == 10 and reduce.prefixes_of(10) == 5
    counts = np.arange(reduce.codes_of(3))
    assert counts[reduce.HIT_CODES].tolist() == [pack_hit(p, True) for p in range(3)]


def test_pack_and_unpack() -> None:
    prefixes, hits = np.array([0, 0, 3, 7]), np.array([False, True, True, False])
    codes = pack_hit(prefixes, hits)
    assert codes.tolist() == [0, 1, 7, 14]
    assert [unpack_hit(code) for code in codes.tolist()] == [(0, False), (0, True), (3, True), (7, False)]


def test_the_sql_packs_as_python_does() -> None:
    duckdb = pytest.importorskip("duckdb", reason="the scale extra")
    rows = duckdb.sql(
        f"SELECT {pack_hit_sql('p + 1', 'h')} FROM (VALUES (-1, false), (-1, true), (4, true)) t(p, h)"
    ).fetchall()
    assert [code for (code,) in rows] == [pack_hit(p + 1, h) for p, h in [(-1, False), (-1, True), (4, True)]]


def test_no_module_packs_by_hand() -> None:
    spelled = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name not in {"reduce.py", "reduce_sql.py"}
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BY_HAND.search(line)
    ]
    assert spelled == []
