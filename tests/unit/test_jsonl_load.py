"""JSON lines into DuckDB (``analysis/duckdb/jsonl.py``): chunks the strict decoder accepts are
parsed by DuckDB's ``read_json``, the others read by the Python validator. Whatever the lines
hold, the table must equal what the Python validator alone makes of the file (``reader.read``),
value for value (the sign of a zero included), row for row, with the same lines, skips, reasons
and example line numbers."""

from __future__ import annotations

import gzip
import math
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlens import records
from kvlens.analysis import reader
from kvlens.analysis.duckdb import inputs, jsonl
from kvlens.analysis.duckdb.engine import Engine
from kvlens.records import wire as records_wire

pytest.importorskip("duckdb")

COLUMNS = inputs.SCALAR_COLUMNS  # every field but prefix_hashes: what `kvlens convert` keeps


def expected(path: Path) -> tuple[reader.ReadResult, list[str]]:
    """The Python validator's reading of ``path``, as the rows the table must hold."""
    read = reader.read([str(path)])
    batch = read.batch
    rows = []
    for i in range(len(batch)):
        row: list[Any] = []
        for name in COLUMNS:
            if name == "model":
                code = int(batch.model_codes[i])
                row.append(batch.model_names[code] if code >= 0 else None)
                continue
            value = getattr(batch, name)[i]
            if isinstance(value, np.integer):
                row.append(None if value < 0 else int(value))
            elif isinstance(value, np.floating):
                row.append(None if math.isnan(value) else float(value))
            else:
                row.append(value)
        rows.append(repr((*row, 0, i)))  # repr: -0.0 and 0.0 differ
    return read, rows


def loaded(
    path: Path, threads: int = 2, whole_file: bool = True
) -> tuple[reader.ReadResult, list[str], list[int | str | None]]:
    """The table ``inputs.load`` makes of ``path``, and what each DuckDB parse returned: a
    chunk's count (None: left to the validator), or "file" when the whole file was inserted
    in one statement (``whole_file=False``: never tried, every chunk is parsed on its own)."""
    engine = Engine(threads=threads)
    parses: list[int | str | None] = []
    parse = jsonl._Parser.__call__
    whole = jsonl._whole_file

    def counted(self: jsonl._Parser, chunk: bytes, lines: int) -> int | None:
        parses.append(parse(self, chunk, lines))
        return parses[-1]  # type: ignore[return-value]

    def whole_counted(*args: Any, **kwargs: Any) -> bool:
        inserted = whole_file and whole(*args, **kwargs)
        if inserted:
            parses.append("file")
        return inserted

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(jsonl._Parser, "__call__", counted)
            patch.setattr(jsonl, "_whole_file", whole_counted)
            result = inputs.load(engine, [str(path)], columns=COLUMNS).read
        rows = engine.connection.execute(
            f"SELECT {', '.join(COLUMNS)}, src, row FROM jsonl_records ORDER BY row"
        ).fetchall()
    finally:
        engine.close()
    return result, [repr(row) for row in rows], parses


def assert_same(path: Path, whole_file: bool = True) -> list[int | str | None]:
    want, want_rows = expected(path)
    got, got_rows, parses = loaded(path, whole_file=whole_file)
    assert got_rows == want_rows
    assert (got.lines, got.ignored, dict(got.skipped), got.examples, got.formats) == (
        want.lines,
        want.ignored,
        dict(want.skipped),
        want.examples,
        want.formats,
    )
    return parses


VALID = (
    b'{"model":"m","prompt_tokens":500,"cached_tokens":140,"queue_seconds":0.1,'
    b'"prefill_seconds":0.25,"ttft_seconds":0.5,"arrival_time":1764547200.5}'
)


def test_clean_chunks_are_parsed_by_duckdb_and_a_bad_line_sends_only_its_chunk_to_the_validator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader, "CHUNK_BYTES", 10 * (len(VALID) + 1))  # 10 lines a chunk
    lines = [VALID] * 95
    lines[42] = VALID.replace(b'"prompt_tokens":500', b'"prompt_tokens":100')  # cached > prompt
    lines[77] = b"{broken".ljust(len(VALID))
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    parses = assert_same(path)
    # 10 chunks (the last of 5 lines): the one with line 43 is parsed, then its check fails;
    # the one with line 78 never reaches DuckDB (the strict decoder refuses it)
    assert len(parses) == 9
    assert parses.count(None) == 1
    assert sum(count for count in parses if count) == 95 - 10 - 10


def test_a_duplicate_key_duckdb_refuses_is_read_by_the_validator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(VALID[:-1] + b',"model":"last"}\n' + VALID + b"\n")
    parses = assert_same(path)
    assert parses == [None]
    assert expected(path)[1][0].startswith("(None, 'last', ")  # request_id, model: the last wins


@pytest.mark.parametrize(("whole_file", "parsed"), [(True, ["file"]), (False, [20_000])])
def test_rows_keep_the_file_order_when_duckdb_reads_in_parallel(
    tmp_path: Path, whole_file: bool, parsed: list[int | str]
) -> None:
    generator = random.Random(7)
    lines = [
        b'{"prompt_tokens":%d,"cached_tokens":0,"ttft_seconds":%r}' % (i, generator.random())
        for i in range(20_000)
    ]
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    want = expected(path)[1]
    _, rows, parses = loaded(path, threads=4, whole_file=whole_file)
    assert parses == parsed
    assert rows == want


# Tricky text for each kind of field: what the strict decoder and DuckDB read differently, or
# what only one of them accepts.
COUNTS = [b"0", b"5", b"-0", b"-1", b"5.0", b"1e2", b'"5"', b"true", b"null", b"10000000", b"10000001",
          b"18446744073709551616", b"[1]", b"{}", b"NaN"]  # fmt: skip
DURATIONS = [b"0.1", b"-0.0", b"-0", b"0", b"1e-7", b"1E5", b"0.30000000000000004441", b"86400",
             b"86400.0000000001", b"NaN", b"Infinity", b"-Infinity", b"1e400", b'"1.5"', b"false",
             b"null", b"2.2250738585072011e-308", b"5e-324", b"123456789.123456789123"]  # fmt: skip
TIMES = [b"1764547200.5", b"1764547200", b"4102444800.1", b"-1", b"1.7645472000000001e9"]
LABELS = [b'"m"', b'""', b'"\\u00e9t\\u00e9"', b'"\xc3\xa9t\xc3\xa9"', b'"a\\u0000"', b'"\\ud800"',
          b'"\\ud83d\\ude00"', b'"' + b"x" * 128 + b'"', b'"' + b"x" * 129 + b'"',
          b'"' + "é".encode() * 64 + b'"', b'"' + "é".encode() * 65 + b'"', b'"\\t"', b'"a\\/b"', b"5",
          b"null", b"[]"]  # fmt: skip
TEXTS = [b'"r1"', b'""', b'"' + b"r" * 32 + b'"', b'"' + b"r" * 33 + b'"', b'"' + b"r" * 256 + b'"',
         b'"' + b"r" * 257 + b'"', b'"\\u00e9"', b"7", b"null"]  # fmt: skip
HASHES = [b"[]", b'[1,"a"]', b"[1.5]", b"[[1]]", b"null", b'"x"', b"[true]", b"[18446744073709551616]"]
FIELDS = {
    "prompt_tokens": COUNTS, "cached_tokens": COUNTS, "output_tokens": COUNTS, "block_size": COUNTS,
    "queue_seconds": DURATIONS, "prefill_seconds": DURATIONS, "ttft_seconds": DURATIONS,
    "decode_seconds": DURATIONS, "e2e_seconds": DURATIONS, "arrival_time": TIMES,
    "model": LABELS, "replica": LABELS, "tenant": LABELS,
    "request_id": TEXTS, "finish_reason": TEXTS, "arm": TEXTS, "prefix_hashes": HASHES,
}  # fmt: skip
# keys beside the record's: unknown ones, and those that make a line another format's
OTHERS = [b'"extra":1', b'"extra":[1,{"a":NaN}]', b'"usage":null', b'"usage":{}', b'"input_tokens":1',
          b'"request_parameters":null', b'"completion_tokens":null,"e2e_latency":null',
          b'"\\u006dodel":"esc"', b'"model":"again"', b'"extra":nan', b'"extra":inf']  # fmt: skip
# whole lines the decoders may disagree on
ODD_LINES = [b"", b"   ", b"{broken", b"[1]", b"5", b"null", b"{}", b'{"prompt_tokens":1,"cached_tokens":0,}',
             b'{"prompt_tokens":1,"cached_tokens":0} {"prompt_tokens":2,"cached_tokens":0}',
             b'{"prompt_tokens":1,"cached_tokens":0}\r', b'\xef\xbb\xbf{"prompt_tokens":1,"cached_tokens":0}',
             b'{"prompt_tokens":1,"cached_tokens":0}//c', b'{"prompt_tokens":1 /*c*/,"cached_tokens":0}',
             b"{'prompt_tokens':1,'cached_tokens':0}",
             b'{"prompt_tokens":1,"cached_tokens":0,"x":1e99999}']  # fmt: skip


def durations() -> st.SearchStrategy[bytes]:
    return st.floats(0, 86_400).flatmap(
        lambda value: st.sampled_from([repr(value), f"{value:.17g}", f"{value:.3e}", f"{value:.20f}"]).map(
            str.encode
        )
    )


@st.composite
def valid_fields(draw: st.DrawFn) -> dict[str, bytes]:
    prompt = draw(st.integers(0, 40_000))
    fields = {
        "prompt_tokens": str(prompt).encode(),
        "cached_tokens": str(draw(st.integers(0, prompt))).encode(),
    }
    for name in ("queue_seconds", "prefill_seconds", "ttft_seconds", "e2e_seconds"):
        if draw(st.booleans()):
            fields[name] = draw(durations())
    for name in ("model", "replica", "tenant"):
        if draw(st.booleans()):
            fields[name] = draw(st.sampled_from([b'"m"', b'"model-2"', b'""', b'"\xc3\xa9"', b'"\\u00e9"']))
    if draw(st.booleans()):
        fields["arrival_time"] = draw(st.sampled_from(TIMES[:2]))
    return fields


def line(fields: dict[str, bytes], *others: bytes) -> bytes:
    pairs = [b'"%s":%s' % (name.encode(), value) for name, value in fields.items()]
    return b"{" + b",".join([*pairs, *others]) + b"}"


@st.composite
def tricky_line(draw: st.DrawFn) -> bytes:
    """A record with one or two fields set to tricky text, perhaps a key beside them; or an odd
    line."""
    fields = draw(valid_fields())
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=2)):
        fields[name] = draw(st.sampled_from(FIELDS[name]))
    others = draw(st.lists(st.sampled_from(OTHERS), max_size=1))
    return draw(st.one_of(st.just(line(fields, *others)), st.sampled_from(ODD_LINES)))


@st.composite
def unchecked_line(draw: st.DrawFn) -> bytes:
    """A record the strict decoder accepts and a check after it refuses: cached_tokens above
    prompt_tokens, or a label that is not printable."""
    fields = draw(valid_fields())
    if draw(st.booleans()):
        fields["cached_tokens"] = str(int(fields["prompt_tokens"]) + draw(st.integers(1, 9))).encode()
    else:
        fields[draw(st.sampled_from(["model", "replica", "tenant"]))] = draw(
            st.sampled_from([b'"\\t"', b'"a\\u0000"'])
        )
    return line(fields)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(valid_fields().map(line), valid_fields().map(line), tricky_line(), unchecked_line()),
        min_size=1,
        max_size=40,
    ),
    st.integers(40, 2_000),
    st.integers(1, 600),
    st.booleans(),
)
def test_any_lines_load_as_the_python_validator_reads_them(
    tmp_path_factory: pytest.TempPathFactory,
    lines: list[bytes],
    chunk_bytes: int,
    slice_bytes: int,
    final_newline: bool,
) -> None:
    path = tmp_path_factory.mktemp("lines") / "r.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reader, "CHUNK_BYTES", chunk_bytes)
        patch.setattr(records_wire, "SLICE_BYTES", slice_bytes)  # several slices a chunk
        assert_same(path)


def test_labels_past_ascii_are_checked_exactly_and_with_the_counts(tmp_path: Path) -> None:
    """A label past printable ASCII leaves the one-statement insert for the staged table and the
    Python label check, which must still refuse a count above its prompt in the same chunk."""
    accented = VALID.replace(b'"model":"m"', '"model":"é"'.encode())
    over = VALID.replace(b'"prompt_tokens":500', b'"prompt_tokens":100')
    unprintable = VALID.replace(b'"model":"m"', b'"model":"\\t"')
    for lines, parsed in (
        ([accented, VALID], ["file"]),
        ([accented, over], [None]),
        ([accented, *[VALID] * 3000, over], [None]),  # the count past DuckDB's first vector
        ([over, accented], [None]),
        ([VALID, unprintable], [None]),
    ):
        path = tmp_path / "r.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        assert assert_same(path) == parsed


def test_a_full_temporary_directory_leaves_the_lines_to_the_validator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: Path, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reader, "CHUNK_BYTES", 2 * (len(VALID) + 1))
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID] * 5) + b"\n")
    monkeypatch.setattr(Path, "write_bytes", full)
    # tried once, then not again (the whole file in one statement writes no file)
    assert assert_same(path, whole_file=False) == [None, None, None]
    assert assert_same(path) == ["file"]


def test_the_next_chunk_is_decoded_while_duckdb_parses_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strict decode of chunk k+1 runs while ``parse`` handles chunk k: ``parse`` waits for
    the next chunk's decode to finish, which it never would if the two ran one after the other
    (then the wait runs out and the chunk counts as not overlapped)."""
    monkeypatch.setattr(reader, "CHUNK_BYTES", 3 * (len(VALID) + 1))  # 3 lines a chunk
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID] * 9) + b"\n")
    decoded = [threading.Event() for _ in range(3)]
    strict = reader.strict_records
    started: list[str] = []

    def decode(chunk: bytes) -> int | None:
        started.append(threading.current_thread().name)
        count = strict(chunk)
        decoded[len(started) - 1].set()
        return count

    overlapped: list[bool] = []

    def parse(chunk: bytes, lines: int) -> int:
        following = len(overlapped) + 1
        overlapped.append(following == len(decoded) or decoded[following].wait(timeout=20))
        return lines

    monkeypatch.setattr(reader, "strict_records", decode)
    result = reader.ReadResult(batch=reader.read([]).batch)
    assert list(reader.parsed_of([str(path)], result, parse)) == [3, 3, 3]
    assert overlapped == [True, True, True]
    assert result.lines == 9
    assert all(name.startswith("kvlens-decode") for name in started)


@pytest.mark.parametrize(
    ("chunk", "lines"),
    [
        (b"{}", 1),
        (b"{}\n{}", 2),
        (b"{}\n", 0),  # a blank line at the end of a block: the chunk ends with its newline
        (b"{}\n{}\n", 0),
        (b"{}\n\n{}", 0),
        (b"{}\n {}", 0),
        (b" {}", 0),
        (b"{}\r\n{}", 0),
        (b"", 0),
    ],
)
def test_record_lines_counts_lines_that_each_start_a_record(chunk: bytes, lines: int) -> None:
    assert reader.record_lines(chunk) == lines


def test_a_chunk_duckdb_refuses_within_a_transaction_keeps_the_chunks_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks are inserted in transactions (``COMMIT_CHUNKS`` a commit); a duplicate key, which
    DuckDB refuses where msgspec keeps the last value, aborts the transaction: the chunks before
    it in the transaction must be inserted again, that one read by the validator."""
    duplicate = VALID[:-1] + b',"model":"last"}'
    monkeypatch.setattr(reader, "CHUNK_BYTES", 2 * (len(duplicate) + 1))  # 2 lines a chunk
    lines = [VALID.ljust(len(duplicate))] * 20  # trailing spaces: all lines as long
    lines[8] = duplicate  # the 5th chunk, the 2nd of the second transaction
    lines[13] = duplicate  # the 7th, the 1st of the third (the one after the refusal)
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    monkeypatch.setattr(jsonl, "COMMIT_CHUNKS", 3)
    assert assert_same(path) == [2, 2, 2, 2, None, 2, None, 2, 2, 2]


@pytest.mark.parametrize("name", ["r.jsonl.gz", "r.jsonl"])
def test_a_gzip_file_by_name_or_by_magic_is_inserted_in_one_statement(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(gzip.compress(b"\n".join([VALID] * 50) + b"\n"))
    assert assert_same(path) == ["file"]


def test_progress_counts_each_byte_once_when_the_file_is_read_again_a_chunk_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader, "CHUNK_BYTES", 4 * (len(VALID) + 1))
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID] * 9 + [b"{broken"]) + b"\n")
    steps: list[int] = []
    engine = Engine()
    try:
        inputs.load(engine, [str(path)], progress=steps.append)
    finally:
        engine.close()
    size = path.stat().st_size
    # read whole until refused (by the decoder at the broken line, or sooner by DuckDB, which reads
    # the same file in a thread and may refuse it first: its pace decides, so the steps before the
    # take-back vary), taken back, then read a chunk at a time: every byte counted once
    back = next(i for i, step in enumerate(steps) if step < 0)
    assert back >= 1 and all(step > 0 for step in steps[:back])
    assert sum(steps[:back]) == -steps[back] <= size
    assert all(step > 0 for step in steps[back + 1 :]) and sum(steps[back + 1 :]) == size


def first_read_changed(monkeypatch: pytest.MonkeyPatch, change: Callable[[list[Any]], list[Any]]) -> None:
    """``reader.file_chunks``, its first call's chunks (the whole file's, as the decoder reads
    them) passed through ``change``; the later calls' as they are."""
    chunks = reader.file_chunks
    calls: list[int] = []

    def changed(*args: Any) -> Iterator[Any]:
        calls.append(1)
        found = list(chunks(*args))
        return iter(change(found) if len(calls) == 1 else found)

    monkeypatch.setattr(reader, "file_chunks", changed)


def test_a_file_with_more_lines_for_duckdb_than_the_decoder_counted_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log still being written: DuckDB, reading after the decoder, finds lines it did not
    count (here the decoder is shown only the first chunk). Nothing of DuckDB's reading is kept."""
    monkeypatch.setattr(reader, "CHUNK_BYTES", 3 * (len(VALID) + 1))
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID] * 7) + b"\n")
    want = expected(path)[1]
    first_read_changed(monkeypatch, lambda found: found[:1])
    _, rows, parses = loaded(path)
    assert parses == [3, 3, 1]  # a chunk at a time, after the whole file was refused
    assert rows == want


def test_ctrl_c_while_the_lines_are_proven_stops_duckdb_and_inserts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID] * 1000) + b"\n")

    def interrupted(chunk: bytes) -> int | None:
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonl.records, "strict_records", interrupted)
    engine = Engine()
    try:
        with pytest.raises(KeyboardInterrupt):
            inputs.load(engine, [str(path)])
        assert [t.name for t in threading.enumerate() if t.name == "kvlens-read-json"] == []
        assert engine.connection.execute("SELECT count(*) FROM jsonl_records").fetchall() == [(0,)]
    finally:
        engine.close()


def test_once_duckdb_refuses_the_file_the_rest_is_not_proven_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate key on the first line: DuckDB refuses the file at once, and the decoder stops
    proving lines that can no longer be inserted in one statement (the first chunk's decode
    here waits for DuckDB's answer)."""
    duplicate = VALID[:-1] + b',"model":"last"}'
    monkeypatch.setattr(reader, "CHUNK_BYTES", 2 * (len(duplicate) + 1))
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([duplicate] + [VALID.ljust(len(duplicate))] * 9) + b"\n")
    strict = jsonl.records.strict_records
    proven: list[int | None] = []

    def after_duckdb(chunk: bytes) -> int | None:
        for thread in threading.enumerate():
            if thread.name == "kvlens-read-json":
                thread.join()
        proven.append(strict(chunk))
        return proven[-1]

    with monkeypatch.context() as patch:
        patch.setattr(jsonl.records, "strict_records", after_duckdb)
        assert assert_same(path) == [None, 2, 2, 2, 2]
    assert proven == [2]


def test_a_file_rewritten_while_read_is_read_again_as_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decoder proves the lines, then the file is rewritten (as many lines, one of them now
    a negative duration the decoder refuses) before DuckDB reads it: what DuckDB read is not
    what was proven, so none of it is kept, and the file is read a chunk at a time as it now is."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID] * 3) + b"\n")
    negative = VALID.replace(b'"queue_seconds":0.1', b'"queue_seconds":-0.1')

    def rewritten(found: list[Any]) -> list[Any]:
        path.write_bytes(b"\n".join([VALID, negative, VALID]) + b"\n")
        return found

    first_read_changed(monkeypatch, rewritten)
    _, rows, parses = loaded(path)
    monkeypatch.undo()
    want, want_rows = expected(path)
    assert parses == []  # the chunk with the refused line: the validator's alone
    assert rows == want_rows
    assert dict(want.skipped) == {"out_of_range": 1}


def test_a_file_named_like_a_pattern_is_read_as_that_file(tmp_path: Path) -> None:
    """DuckDB reads ``*?[`` in a name as a pattern: a walked directory's ``log[12].jsonl`` would
    be read as ``log1.jsonl`` beside it (as many lines: the counts match), its records lost."""
    other = VALID.replace(b'"model":"m"', b'"model":"other"')
    (tmp_path / "log1.jsonl").write_bytes(b"\n".join([other] * 3) + b"\n")
    path = tmp_path / "log[12].jsonl"
    path.write_bytes(b"\n".join([VALID] * 3) + b"\n")
    engine = Engine()
    try:
        loaded = inputs.load(engine, [str(tmp_path)], columns=COLUMNS)
        models = engine.connection.execute(
            "SELECT src, list(model ORDER BY row) FROM jsonl_records GROUP BY src ORDER BY src"
        ).fetchall()
    finally:
        engine.close()
    assert loaded.files == [str(tmp_path / "log1.jsonl"), str(path)]
    assert models == [(0, ["other"] * 3), (1, ["m"] * 3)]


def test_ctrl_c_while_waiting_for_duckdb_stops_it_and_inserts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every line proven, the reading thread waits for DuckDB's insert: Ctrl-C there must stop
    DuckDB too (else it goes on inserting into a connection the caller closes) and roll back.
    DuckDB's insert is made endless here; the wait is what Ctrl-C interrupts."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID] * 10) + b"\n")
    insert = jsonl._Parser.insert_checked

    def endless(self: jsonl._Parser, lines_query: str, labels: list[str]) -> int:
        self.connection.execute("SELECT max(md5(range::VARCHAR)) FROM range(1000000000000)")
        return insert(self, lines_query, labels)

    class Interrupted(threading.Thread):
        def join(self, timeout: float | None = None) -> None:
            if self.name == "kvlens-read-json" and not hasattr(self, "interrupted"):
                self.interrupted = True
                raise KeyboardInterrupt
            super().join(timeout)

    monkeypatch.setattr(jsonl._Parser, "insert_checked", endless)
    monkeypatch.setattr(jsonl.threading, "Thread", Interrupted)
    engine = Engine()
    try:
        with pytest.raises(KeyboardInterrupt):
            inputs.load(engine, [str(path)])
        running = [t for t in threading.enumerate() if t.name == "kvlens-read-json"]
        for thread in running:  # on failure, not left running
            engine.connection.interrupt()
            thread.join()
        assert running == []
        assert engine.connection.execute("SELECT count(*) FROM jsonl_records").fetchall() == [(0,)]
    finally:
        engine.close()


def test_a_file_rewritten_before_its_labels_past_ascii_are_read_again_is_read_as_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A label past ASCII: DuckDB reads the whole file a second time (into the staged table)
    to check its labels in Python. A file rewritten just before that read (as many lines, one
    now with a negative duration the decoder refuses) must not have those rows kept."""
    accented = VALID.replace(b'"model":"m"', b'"model":"\xc3\xa9"')
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([VALID, accented, VALID]) + b"\n")
    staged = jsonl._Parser._staged

    def rewritten_first(self: jsonl._Parser, lines_query: str, labels: list[str]) -> int | None:
        negative = accented.replace(b'"queue_seconds":0.1', b'"queue_seconds":-0.1')
        path.write_bytes(b"\n".join([VALID, negative, VALID]) + b"\n")
        monkeypatch.setattr(jsonl._Parser, "_staged", staged)  # once
        return staged(self, lines_query, labels)

    monkeypatch.setattr(jsonl._Parser, "_staged", rewritten_first)
    _, rows, parses = loaded(path)
    monkeypatch.undo()
    want, want_rows = expected(path)
    assert dict(want.skipped) == {"out_of_range": 1}
    assert parses == []  # the chunk with the refused line: the validator's alone
    assert rows == want_rows


def test_labels_past_ascii_are_fetched_into_python_a_bounded_number_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each distinct label past printable ASCII is checked in Python: for a file read whole
    (millions of distinct tenants) they are fetched LABELS_AT_A_TIME at a time, never all the
    file's at once; the first invalid one stops the check."""
    monkeypatch.setattr(jsonl, "LABELS_AT_A_TIME", 2, raising=False)
    lines = [VALID.replace(b'"model":"m"', b'"model":"\xc3\xa9%d"' % i) for i in range(6)]
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    valid = records.labels_valid

    def checked(path: Path) -> tuple[list[int | str | None], list[int]]:
        """What each parse returned, and how many labels each Python check was given."""
        sizes: list[int] = []

        def counted(labels: Any) -> bool:
            labels = list(labels)
            sizes.append(len(labels))
            return valid(labels)

        want = expected(path)[1]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(records, "labels_valid", counted)
            _, rows, parses = loaded(path)
        assert rows == want
        return parses, sizes

    assert checked(path) == (["file"], [2, 2, 2])
    tab = VALID.replace(b'"model":"m"', b'"model":"\xc3\xa9\\t"')
    path.write_bytes(b"\n".join([*lines, tab]) + b"\n")
    # an invalid label: the file (one chunk) is the validator's, which checks a chunk's at once
    assert checked(path)[0] == [None]


def test_duckdb_stopped_before_its_statement_starts_does_not_parse_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first chunk refused at once (a carriage return: no line decoded) stops DuckDB before
    its statement may have started; DuckDB forgets an interrupt that comes before, and went on
    to parse the whole file (1.7 s for 320 MB, as long again as the file) while the reader
    waited. The statement here, once let start by the first interrupt, runs ~1 s unless
    interrupted again."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\r\n".join([VALID] * 3) + b"\r\n")
    engine = Engine(threads=1)
    interrupted = threading.Event()
    ran: list[str] = []
    insert = jsonl._Parser.insert_checked

    class Connection:
        def __init__(self, connection: Any) -> None:
            self.connection = connection

        def interrupt(self) -> None:
            self.connection.interrupt()
            interrupted.set()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.connection, name)

    def late(self: jsonl._Parser, lines_query: str, labels: list[str]) -> int:
        interrupted.wait()  # the statement starts only after the first interrupt
        try:
            self.connection.execute("SELECT max(md5(range::VARCHAR)) FROM range(3000000)")
        except Exception as error:
            ran.append(type(error).__name__)
            raise
        ran.append("whole statement")
        return insert(self, lines_query, labels)

    monkeypatch.setattr(jsonl._Parser, "insert_checked", late)
    engine.connection = Connection(engine.connection)
    try:
        inputs.load(engine, [str(path)], columns=COLUMNS)
    finally:
        engine.connection = engine.connection.connection
        engine.close()
    assert ran == ["InterruptException"]
