"""The "little reuse" finding's prefix potential from ``prefix_hashes``: the ``duckdb`` engine's
SQL (:mod:`kvlens.analysis.duckdb.potential`) against the numpy engine's walk, on the same
files (the Mooncake trace, tricky hashes, every read path), so that ``auto`` may pick either."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlens.analysis.analyze import analyze, choose_engine
from kvlens.config import load_settings
from tests.unit.test_columnar import write_jsonl

pytest.importorskip("duckdb")

MOONCAKE = Path(__file__).parents[2] / "service/kvlens/simulate/data/mooncake_synthetic_trace.jsonl.gz"


def mooncake_records() -> list[dict[str, Any]]:
    """The Mooncake trace as kvlens records: little reuse delivered (every 7th request reuses
    one block), 512-token blocks, arrival times with ties (many share a millisecond)."""
    out = []
    for i, line in enumerate(gzip.decompress(MOONCAKE.read_bytes()).splitlines()):
        trace = orjson.loads(line)
        out.append(
            {
                "prompt_tokens": trace["input_length"],
                "cached_tokens": min(512, trace["input_length"]) if i % 7 == 0 else 0,
                "output_tokens": trace["output_length"],
                "arrival_time": 1_800_000_000 + trace["timestamp"] / 1000,
                "block_size": 512,
                "prefix_hashes": trace["hash_ids"],
            }
        )
    return out


def both(paths: list[str], **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    numpy_report, _ = analyze(paths, load_settings(), engine="numpy", **kwargs)
    duckdb_report, _ = analyze(paths, load_settings(), engine="duckdb", **kwargs)
    return numpy_report, duckdb_report


def little_reuse(report: dict[str, Any]) -> dict[str, Any]:
    (finding,) = [f for f in report["diagnosis"] if f["id"] == "little_reuse"]
    return finding  # type: ignore[no-any-return]


def test_the_mooncake_trace_gives_the_same_report_in_both_engines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mooncake.jsonl", mooncake_records())
    expected, got = both([str(path)])
    numbers = little_reuse(expected)["numbers"]
    assert numbers["records_with_hashes"] == 3993
    assert 0.3 < numbers["unbounded_cache_token_reuse"] < 0.9  # the trace shares prefixes
    assert got == expected


def test_a_chunk_read_by_the_validator_carries_its_hashes(tmp_path: Path) -> None:
    """A bad line sends its chunk through the Python validator (a batch, not DuckDB's parse)."""
    path = write_jsonl(tmp_path / "mooncake.jsonl", mooncake_records()[:500], extra=b"{broken\n")
    expected, got = both([str(path)])
    assert little_reuse(expected)["numbers"]["records_with_hashes"] == 500
    assert got == expected


def test_files_without_hashes_give_no_potential_in_either_engine(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [
        {"prompt_tokens": 1000, "cached_tokens": 0, "prefix_hashes": [] if i % 2 else None} for i in range(9)
    ]
    expected, got = both([str(write_jsonl(tmp_path / "a.jsonl", records))])
    assert "prefix_hashes would tell" in little_reuse(expected)["detail"]
    assert got == expected


# Hashes as JSON text, which Python holds equal or apart where the text differs or agrees:
# 1 and "1" differ, "\u0041" is "A", -0 is 0, integers past 64 bits are exact.
HASHES = st.sampled_from(
    ["1", '"1"', "0", '"A"', '"\\u0041"', "-0", str(2**64 + 1), str(2**64 + 2), "-5", '"\u00e9"', '"q\\""']
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.lists(HASHES, max_size=6),
            st.sampled_from([None, 1.0, 2.0, 3.0]),  # ties and records without an arrival time
            st.sampled_from([None, 1, 16, 64]),
            st.integers(1, 400),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_drawn_hashes_give_the_same_potential(tmp_path: Path, drawn: list[Any]) -> None:
    lines = []
    for hashes, arrival, block, prompt in drawn:
        text = "[" + ", ".join(hashes) + "]"
        fields: dict[str, Any] = {"prompt_tokens": prompt, "cached_tokens": 0}
        if arrival is not None:
            fields["arrival_time"] = arrival
        if block is not None:
            fields["block_size"] = block
        lines.append(orjson.dumps(fields)[:-1] + b', "prefix_hashes": ' + text.encode() + b"}\n")
    path = tmp_path / "drawn.jsonl"
    path.write_bytes(b"".join(lines))
    expected, got = both([str(path)])
    assert got["diagnosis"] == expected["diagnosis"]


def test_auto_is_duckdb_but_for_small_local_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both engines give one report: ``auto`` picks the faster, numpy only under
    AUTO_DUCKDB_BYTES (DuckDB's start costs more than it saves there)."""
    from kvlens.analysis import analyze as module

    small = write_jsonl(tmp_path / "small.jsonl", mooncake_records()[:3])
    assert choose_engine("auto", [str(small)]) == "numpy"
    assert choose_engine("auto", ["-"]) == "duckdb"  # of unknown size
    monkeypatch.setattr(module, "AUTO_DUCKDB_BYTES", small.stat().st_size)
    assert choose_engine("auto", [str(small)]) == "duckdb"
    assert choose_engine("numpy", [str(small)]) == "numpy"


def test_hashes_of_chunks_inserted_again_after_a_refusal_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk DuckDB refuses (a duplicate key) rolls its transaction back: the chunks before it
    are inserted again, their hashes with them, and that chunk's come from the validator."""
    from kvlens.analysis import reader
    from kvlens.analysis.duckdb import jsonl

    lines = [
        orjson.dumps({"prompt_tokens": 64, "cached_tokens": 0, "prefix_hashes": [i % 3, i], "block_size": 16})
        for i in range(20)
    ]
    lines[8] = lines[8][:-1] + b',"block_size":16}'  # the key twice: DuckDB refuses, msgspec keeps the last
    width = max(map(len, lines))
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"".join(line.ljust(width) + b"\n" for line in lines))
    monkeypatch.setattr(reader, "CHUNK_BYTES", 2 * (width + 1))  # 2 lines a chunk
    monkeypatch.setattr(jsonl, "COMMIT_CHUNKS", 3)
    expected, got = both([str(path)])
    assert little_reuse(expected)["numbers"]["records_with_hashes"] == 20
    assert got == expected


def test_the_sections_read_from_hashes_are_the_same_in_both_engines(tmp_path: Path) -> None:
    """``misses`` and ``cross_tenant`` walk the records holding hashes, with their request ids,
    replicas and tenants: the duckdb engine hands those records to the same walks."""
    records = [
        {
            **record,
            "request_id": f"req-{i}" if i % 5 else "",
            "replica": f"r{i % 3}",
            "tenant": ["acme", "globex", ""][i % 3],
        }
        for i, record in enumerate(mooncake_records()[:800])
    ]
    path = write_jsonl(tmp_path / "tenants.jsonl", records, extra=b"{broken\n")
    expected, got = both([str(path)])
    assert expected["misses"] is not None
    assert expected["cross_tenant"]["records_checked"] > 0
    assert got == expected


def test_auto_reads_records_with_sessions_with_the_engine_that_reports_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-session reuse and the trace's theoretical reuse come from the numpy engine only: a
    replay's records (each names its session) past the size where auto takes DuckDB must still
    get them, not a report without the section."""
    import kvlens.analysis.analyze as module

    replayed = tmp_path / "replay.jsonl"
    replayed.write_bytes(
        b"".join(
            orjson.dumps(
                {
                    "prompt_tokens": 100,
                    "cached_tokens": 50 * (i % 2),
                    "session_id": f"s{i % 3}",
                    "trace_reusable_tokens": 60,
                }
            )
            + b"\n"
            for i in range(30)
        )
    )
    monkeypatch.setattr(module, "AUTO_DUCKDB_BYTES", 0)
    assert choose_engine("auto", [str(replayed)]) == "numpy"
    result, _ = analyze([str(replayed)], load_settings(), engine=choose_engine("auto", [str(replayed)]))
    assert result["sessions"] is not None and result["sessions"]["sessions"] == 3
