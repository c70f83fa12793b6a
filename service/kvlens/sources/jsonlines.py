"""JSON lines from outside: files read in blocks of whole lines with a bound on a line's length
(``kvlens analyze`` and ``compare``, and the simulator's and the replay's traces), and decoding:
orjson first, then the standard library, which also reads NaN, Infinity and 1e400, so that those
are rejected by field with a clear reason rather than as undecodable lines."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import numpy as np
import orjson

from kvlens import jsonscan
from kvlens.records import Rejections, Validated, batch_from_objects
from kvlens.sources.formats import NOT_A_REQUEST

UNDECODABLE: Any = object()
# A longer line is skipped without being held: a file with no newline (a link to /dev/zero) would
# otherwise be gathered whole in memory. At least a reader's block (CHUNK_BYTES of
# analysis/reader.py): a line within one block is not measured.
MAX_LINE_BYTES = 64 * 1024 * 1024
TOO_LONG_LINE = b"(a line longer than MAX_LINE_BYTES, not read)"
log = logging.getLogger("kvlens")
_GZIP = b"\x1f\x8b"
_NEWLINE = ord("\n")


def decode_lines(lines: Iterable[bytes]) -> tuple[list[Any], list[int], list[int]]:
    """JSON lines (blank ones skipped, not counted): the values, their line indices, and the
    indices of lines that do not decode."""
    objects: list[Any] = []
    positions: list[int] = []
    malformed: list[int] = []
    index = 0
    for line in lines:
        if not line.strip():
            continue
        value = loads(line)
        if value is UNDECODABLE:
            malformed.append(index)
        else:
            objects.append(value)
            positions.append(index)
        index += 1
    return objects, positions, malformed


def records_from_lines(lines: Iterable[bytes], convert: Callable[[Any], Any]) -> tuple[Validated, int]:
    """Decode, convert (a format of :mod:`kvlens.sources.formats`) and validate JSON lines; also
    the number of lines that describe no request (:data:`~kvlens.sources.formats.NOT_A_REQUEST`)."""
    objects, positions, malformed = decode_lines(lines)
    converted = [convert(value) for value in objects]
    if any(value is NOT_A_REQUEST for value in converted):
        kept = [(value, position) for value, position in zip(converted, positions, strict=True)]
        kept = [(value, position) for value, position in kept if value is not NOT_A_REQUEST]
        ignored = len(converted) - len(kept)
        converted, positions = [value for value, _ in kept], [position for _, position in kept]
    else:
        ignored = 0
    validated = batch_from_objects(converted, positions)
    return validated.with_rejections(Rejections.single(malformed, "malformed_json")), ignored


def loads(data: bytes) -> Any:
    """orjson, then the standard library (which reads NaN/Infinity/1e400 for field-level errors)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return jsonscan.decode(json.loads, data)
    except ValueError:
        return UNDECODABLE


def is_gzip(path: str) -> bool:
    """Whether :func:`open_file` reads the regular file ``path`` through gzip."""
    with open(path, "rb") as raw:
        return _gzipped(path, raw.read(2))


def _gzipped(path: str, head: bytes) -> bool:
    return path.endswith(".gz") or head == _GZIP


@contextlib.contextmanager
def open_file(path: str) -> Iterator[IO[bytes]]:
    """The file (or stdin for ``-``), decompressed when gzip by name or by magic bytes, opened
    once: the magic bytes are peeked, not read, so a pipe named as a file (a FIFO, a shell's
    ``<(zcat ...)``) gives its bytes from the first (reopening it lost a buffer's worth, or
    waited for a writer that never came)."""
    raw: IO[bytes] = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        head = raw.peek(2)[:2] if isinstance(raw, io.BufferedReader) else b""
        if _gzipped(path, head):
            with gzip.GzipFile(fileobj=raw) as unpacked:
                yield unpacked  # type: ignore[misc]
        else:
            yield raw
    finally:
        if path != "-":
            raw.close()


def line_chunks(
    stream: IO[bytes],
    chunk_bytes: int,
    progress: Callable[[int], None] | None = None,
    path: str = "-",
    warn: Callable[[str], None] = log.warning,
    too_long: Callable[[int], None] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """(number of the chunk's first line, whole lines of about ``chunk_bytes`` joined by ``\n``,
    without the last newline). A block is read and split in C calls: reading line by line costs
    several Python steps a line, more than decoding it. A line longer than
    :data:`MAX_LINE_BYTES` is not held: its bytes are dropped as they come and the line is given
    as :data:`TOO_LONG_LINE` (not JSON: a reader counts it as ``malformed_json`` where it
    stood), and ``too_long`` is told its number as soon as it passes the limit (default: a
    warning); a ``too_long`` that raises ends the reading there (a line that never ends, from
    /dev/zero, is then not read for good). A gzip stream that breaks is ``warn``-ed about after
    the lines before the break."""
    tell = too_long or (lambda line: warn(_too_long(path, line)))
    line_number = 1
    pieces: list[bytes] = []  # a line longer than a block spans several reads
    held = 0  # bytes in pieces
    dropping = False  # within a line past MAX_LINE_BYTES
    blocks = _Blocks(stream, chunk_bytes)
    for block in blocks:
        if progress is not None:
            progress(len(block))
        first = block.find(b"\n")
        if first < 0:  # the line goes on
            held += len(block)
            if not dropping and held > MAX_LINE_BYTES:
                tell(line_number)
                pieces, dropping = [], True
            if not dropping:
                pieces.append(block)
            continue
        if dropping or held + first > MAX_LINE_BYTES:  # the long line ends here
            if not dropping:
                tell(line_number)
            pieces, dropping = [TOO_LONG_LINE], False
            block = block[first:]
        cut = block.rfind(b"\n")
        whole = b"".join((*pieces, memoryview(block)[:cut]))  # one copy, not two
        pieces = [block[cut + 1 :]]
        held = len(pieces[0])
        yield line_number, whole
        line_number += _newlines(whole) + 1
    rest = TOO_LONG_LINE if dropping else b"".join(pieces)
    if rest:
        yield line_number, rest
        line_number += rest.count(b"\n") + 1
    if blocks.broken:
        warn(f"{path}: {blocks.broken}: the {line_number - 1:,} lines before it are read")


def _too_long(path: str, line: int) -> str:
    return f"{path}: line {line:,} is longer than {MAX_LINE_BYTES:,} bytes: not read (malformed_json)"


class _Blocks:
    """The stream's blocks of up to ``size`` bytes, gathered from ``read1`` calls, so that a gzip
    stream that breaks (cut short: ``EOFError``; corrupt: ``zlib.error``) has given every byte
    before the break (one ``read`` of a block would lose the whole block); ``broken`` then says
    why, and the blocks end there."""

    def __init__(self, stream: IO[bytes], size: int) -> None:
        self.stream = stream
        self.size = size
        self.broken = ""

    def __iter__(self) -> Iterator[bytes]:
        read1 = getattr(self.stream, "read1", self.stream.read)
        while not self.broken:
            parts, size = [], 0
            try:
                while size < self.size and (part := read1(self.size - size)):
                    parts.append(part)
                    size += len(part)
            except EOFError:
                self.broken = "the gzip stream ends before its end (the file was cut short)"
            except (zlib.error, gzip.BadGzipFile):
                self.broken = "the gzip stream is corrupt here"
            if not parts:
                return
            yield b"".join(parts)


def _newlines(data: bytes) -> int:
    """``data.count(b"\n")``, in numpy: CPython counts a byte a step, numpy several (a
    chunk's count cost ~7 ms against ~2.5 ms, on the thread that reads and proves the lines)."""
    return int(np.count_nonzero(np.frombuffer(data, np.uint8) == _NEWLINE))
