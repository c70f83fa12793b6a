"""Read recorded traffic for ``kvlens analyze`` and ``kvlens compare``.

Files are JSON lines (gzip by name or magic bytes; ``-`` is stdin) in the live sources' formats,
read by the same parsers: kvlens records (also what the vLLM plugin writes with
``KVLENS_PLUGIN_FILE``), SGLang's per-request export, and ``openai-usage`` gateway logs. A
file's format is detected from its first record unless given. A line of another format is
named and skipped, never misread; a malformed or invalid line is reported with its file and
line number and skipped; the lines beside it still count.
"""

from __future__ import annotations

import logging
import os
import stat
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvlens.errors import InputError, MissingExtra
from kvlens.records import (
    RecordBatch,
    Rejections,
    batch_from_json_lines,
    batch_from_objects,
    strict_records,
)
from kvlens.sources import formats
from kvlens.sources.jsonlines import UNDECODABLE, line_chunks, loads, open_file

# Read at a time: whole lines of about this much are one batch. A line is bounded by
# jsonlines.MAX_LINE_BYTES (64 MiB): a longer one is one malformed_json line, never held.
CHUNK_BYTES = 8 * 1024 * 1024
log = logging.getLogger("kvlens")
PARQUET_SUFFIXES = (".parquet", ".pq")
_PARQUET_MAGIC = b"PAR1"
_NEWLINE, _BRACE = ord("\n"), ord("{")
MAX_EXAMPLES = 20
T = TypeVar("T")


def detect_format(value: Any) -> str | None:
    """The format a decoded line looks like, or None when it looks like none."""
    if not isinstance(value, dict):
        return None
    if "request_parameters" in value or ("completion_tokens" in value and "e2e_latency" in value):
        return "sglang"
    if isinstance(value.get("usage"), dict) or "input_tokens" in value or "prompt_tokens_details" in value:
        return "openai-usage"
    if "prompt_tokens" in value:
        return "kvlens"
    return None


@dataclass
class ReadResult:
    batch: RecordBatch
    lines: int = 0
    ignored: int = 0  # lines that describe no request (streaming chunks before the last)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> lines
    examples: list[dict[str, Any]] = field(default_factory=list)  # the first skipped lines, why
    formats: dict[str, str] = field(default_factory=dict)  # file -> format read

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


def read(
    paths: Sequence[str],
    *,
    format_name: str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReadResult:
    """All records of the JSON-lines files ``paths`` name (:func:`resolve`); ``progress`` is
    told how many bytes were read as reading goes."""
    files = resolve(paths)
    refuse_parquet(files)
    result = ReadResult(batch=batch_from_objects([]).batch)
    batches = list(batches_of(files, result, format_name=format_name, model=model, progress=progress))
    if batches:
        result.batch = RecordBatch.concat(batches)
    return result


def resolve(names: Sequence[str]) -> list[str]:
    """The files that ``names`` name: the one rule of every engine, so that which files are read
    never depends on which engine reads them. A name is the path it spells, never a pattern (a
    shell has expanded the user's patterns already: ``[ab].jsonl`` left to kvlens is the file of
    that name, not ``a.jsonl`` and ``b.jsonl``); a directory is every file below it, hidden ones
    aside, in name order (a hive layout such as ``day=2026-11-30/model=x/part-0.parquet``
    works). A name that reaches nothing is an error, not an empty input. A file reached by
    several names (named twice, a symbolic link, a link back up a walked tree) is read once,
    under the first. ``-`` is stdin; a pipe named as a file (a FIFO, ``<(zcat ...)``) is read as
    a stream of JSON lines, one found by a walk is left out (nothing may ever write to it:
    reading would wait for ever). Object-storage URLs of Parquet files (``s3://.../x.parquet``,
    where DuckDB's own patterns are meant: no shell lists a bucket) are kept for DuckDB to list.
    A resolved list resolves to itself."""
    out: list[str] = []
    for name in names:
        if "://" in name and not name.endswith(PARQUET_SUFFIXES):
            raise InputError(f"{name}: only Parquet is read from a URL (name it .parquet)")
        if name == "-" or "://" in name:
            out.append(name)
        elif os.path.isdir(name):
            out.extend(
                sorted(
                    str(path)
                    for path in Path(name).rglob("*")
                    if path.is_file()
                    and not any(part.startswith(".") for part in path.relative_to(name).parts)
                )
            )
        elif os.path.exists(name):  # a file, or a pipe (a FIFO, <(zcat ...)) read as a stream
            out.append(name)
        else:
            wildcards = any(char in name for char in "*?[{")
            raise InputError(
                f"{name}: no such file or directory"
                + (
                    " (a name is read as the path it spells, never as a pattern: let the shell "
                    "expand patterns, or name a directory)"
                    if wildcards
                    else ""
                )
            )
    return _distinct(out)


def _distinct(paths: list[str]) -> list[str]:
    """``paths`` with each regular file once, under the first name that reaches it. Streams
    (``-``, pipes) and URLs are kept as given."""
    out: list[str] = []
    seen: set[tuple[int, int]] = set()
    for path in paths:
        try:
            status = None if path == "-" or "://" in path else os.stat(path)
        except OSError:
            status = None
        if status is not None and stat.S_ISREG(status.st_mode):
            if (status.st_dev, status.st_ino) in seen:
                continue
            seen.add((status.st_dev, status.st_ino))
        out.append(path)
    return out


def is_parquet(path: str) -> bool:
    """Whether ``path`` is Parquet: by its suffix, or a regular file by its magic bytes
    (``PAR1``: a warehouse export is often named without a suffix). A pipe is read once, as
    lines."""
    if path.endswith(PARQUET_SUFFIXES):
        return True
    if path == "-" or "://" in path or not os.path.isfile(path):
        return False
    with open(path, "rb") as probe:
        return probe.read(len(_PARQUET_MAGIC)) == _PARQUET_MAGIC


def refuse_parquet(paths: Sequence[str]) -> None:
    """Refuse Parquet among ``paths`` (resolved) before anything is read: this reader takes JSON
    lines, and read as lines a Parquet file is only "malformed_json" lines."""
    for path in paths:
        if is_parquet(path):
            try:
                import duckdb  # noqa: F401
            except ModuleNotFoundError:
                raise MissingExtra(f"{path} is Parquet: reading it (DuckDB)", "scale") from None
            raise InputError(
                f"{path} is Parquet: the numpy engine reads JSON lines only; use --engine duckdb (or auto)"
            )


def batches_of(
    paths: list[str],
    result: ReadResult,
    *,
    format_name: str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[RecordBatch]:
    """The records of ``paths``, one batch of whole lines of about ``CHUNK_BYTES`` at a time (so a
    caller that does not keep them holds one chunk); lines, skips and formats go to ``result``."""
    for path, first_line, chunk, file_format in file_chunks(paths, result, format_name, progress):
        yield _read_chunk(path, first_line, chunk, file_format, model, result)


def parsed_of(
    paths: list[str],
    result: ReadResult,
    parse: Callable[[bytes, int], T | None],
    *,
    format_name: str | None = None,
    model: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[RecordBatch | T]:
    """Like :func:`batches_of`, but a chunk of kvlens lines that the strict decoder accepts (every
    line one valid record of known fields only, no blank line) is given to ``parse`` as it is
    (the lines joined by ``\n``, and their number) and what ``parse`` returns is yielded instead
    of a batch: a columnar engine parses the text for a fraction of what building Python objects
    costs. ``parse`` must make the two checks the decoder leaves (``records.strict_records``) and
    return None when one fails or it cannot parse the text; the chunk is then read as
    :func:`batches_of` reads it, so the records, skips and line numbers are the same. The strict
    decoder runs in a thread, one chunk ahead of ``parse`` (:func:`_decoded_ahead`)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlens-decode") as decoder:
        chunks = file_chunks(paths, result, format_name, progress)
        for path, first_line, chunk, file_format, lines, strict in _decoded_ahead(decoder, chunks, model):
            try_fast = True
            if strict is not None:
                try_fast = strict.result() == lines
                if try_fast and (parsed := parse(chunk, lines)) is not None:
                    result.lines += lines
                    yield parsed
                    continue
            yield _read_chunk(path, first_line, chunk, file_format, model, result, try_fast=try_fast)


def _decoded_ahead(
    decoder: ThreadPoolExecutor, chunks: Iterator[tuple[str, int, bytes, str]], model: str | None
) -> Iterator[tuple[str, int, bytes, str, int, Future[int | None] | None]]:
    """Each chunk of ``chunks``, its number of record lines (:func:`record_lines`, 0 for
    another format or with a ``model``) and, for those, the strict decode of it started in
    ``decoder``, one chunk ahead: a chunk is yielded once the next one's decode is under way, so
    that msgspec (which holds the GIL) decodes chunk k+1 while the caller's engine (which
    releases it) parses chunk k: on two cores the two parses overlap (less wall time, the same
    CPU). At most two chunks are held."""
    pending = None
    for path, first_line, chunk, file_format in chunks:
        lines = record_lines(chunk) if file_format == "kvlens" and model is None else 0
        strict = decoder.submit(strict_records, chunk) if lines else None
        if pending is not None:
            yield pending
        pending = (path, first_line, chunk, file_format, lines, strict)
    if pending is not None:
        yield pending


def file_chunks(
    paths: list[str],
    result: ReadResult,
    format_name: str | None,
    progress: Callable[[int], None] | None,
    warn: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, int, bytes, str]]:
    """(path, number of the chunk's first line, chunk, the file's format) for every chunk of
    ``paths``; the formats read go to ``result``; ``warn`` is given what ends a file early
    (default: logged as a warning)."""
    for path in paths:
        with open_file(path) as stream:
            file_format = format_name
            for first_line, chunk in line_chunks(stream, CHUNK_BYTES, progress, path, warn or log.warning):
                if file_format is None:
                    file_format = _first_format(chunk) or "kvlens"
                    result.formats[path] = file_format
                yield path, first_line, chunk, file_format
            result.formats.setdefault(path, file_format or "kvlens")


def _first_format(chunk: bytes) -> str | None:
    for line in chunk.split(b"\n"):
        if line.strip():
            detected = detect_format(loads(line))
            if detected:
                return detected
    return None


def record_lines(chunk: bytes) -> int:
    """The number of lines of the chunk when each starts with ``{`` (no blank line, no indent)
    and none ends with a carriage return, else 0. Then each line holds at least one value, and
    none spans lines (a line inside a record would start a nested object, which no field
    holds): as many records as lines means one a line."""
    if not chunk.startswith(b"{") or chunk.endswith(b"\n") or b"\r" in chunk:
        return 0
    # one pass over the bytes in numpy, where counting "\n" and "\n{" took two slower ones
    text = np.frombuffer(chunk, np.uint8)
    breaks = np.flatnonzero(text == _NEWLINE)  # the chunk does not end with one: each has a next byte
    return breaks.size + 1 if bool((text[breaks + 1] == _BRACE).all()) else 0


def _read_chunk(
    path: str,
    first_line: int,
    chunk: bytes,
    file_format: str,
    model: str | None,
    result: ReadResult,
    *,
    try_fast: bool = True,  # False: the strict decoder refused the chunk already
) -> RecordBatch:
    if try_fast and file_format == "kvlens" and model is None and (lines := record_lines(chunk)):
        fast = batch_from_json_lines(chunk, keep_prefix_hashes=True)
        if fast is not None and len(fast) == lines:  # one record a line, each valid
            result.lines += lines
            return fast
    numbered = [
        (first_line + i, line.rstrip(b"\r")) for i, line in enumerate(chunk.split(b"\n")) if line.strip()
    ]
    result.lines += len(numbered)
    convert = formats.converter(file_format, model=model)
    objects, positions = [], []
    for number, line in numbered:
        value = loads(line)
        if value is UNDECODABLE:
            _skip(result, path, number, None, "malformed_json", "the line is not valid JSON")
            continue
        detected = detect_format(value)
        if detected is not None and detected != file_format:
            _skip(
                result, path, number, None, "other_format", f"looks like {detected} in a {file_format} file"
            )
            continue
        record = convert(value)
        if record is formats.NOT_A_REQUEST:
            result.ignored += 1
            continue
        objects.append(record)
        positions.append(number)
    validated = batch_from_objects(objects, positions)
    _count_rejections(result, path, validated.rejections)
    return validated.batch


def _count_rejections(result: ReadResult, path: str, rejections: Rejections) -> None:
    for reason, count in rejections.counts_by_reason().items():
        result.skipped[reason] += count
    room = MAX_EXAMPLES - len(result.examples)
    for detail in rejections.details(room) if room > 0 else []:
        result.examples.append({"file": path, "line": detail["index"], **detail})
        del result.examples[-1]["index"]


def _skip(
    result: ReadResult, path: str, line: int, field_name: str | None, reason: str, message: str
) -> None:
    result.skipped[reason] += 1
    if len(result.examples) < MAX_EXAMPLES:
        result.examples.append(
            {"file": path, "line": line, "field": field_name, "reason": reason, "message": message}
        )
