"""Follow JSON-lines files matched by a glob, as log shippers do, by polling.

A file is known by its device and inode, not its name, and kept open while it is followed, so:

- rename rotation: the renamed file is read to its end, the new file at the old name from 0;
- delete and recreate: the deleted file is read to its end through the open descriptor;
- truncation and copytruncate: a file shorter than the offset is read again from 0 (lines
  written between the copy and the truncation are lost, as with every shipper);
- a partial last line waits for its newline and is counted once;
- a line longer than ``max_line_bytes`` is not held whole: its small top-level fields are kept as
  it streams past (:class:`~kvlens.sources.jsonscan.FieldExtractor`) and the line is counted from
  them (a "shortened" line), so SGLang's lines, whose ``request_parameters`` carry the whole
  prompt, are never lost to their size; a long line that is not a JSON object is skipped and
  counted as ``too_long``. Either way it is counted once, also across a restart in its middle.

The glob must not match rotated copies (``app.log.1``), or they would be read as new files.

Lines are read in batches of at most :data:`BATCH_BYTES` (plus one partial line), so memory does
not depend on how much is waiting. After a batch is counted, the offsets are checkpointed to a JSON
file written atomically (temporary file, fsync, rename): the checkpoint is never ahead of what was
counted (inside a line, it points at the line's start), so a crash re-reads at most one batch and
never loses one. A checkpoint that cannot be
written loses nothing either: the lines are counted, the failure is reported (readiness, metrics)
and the write is tried again after the next batch. A restart resumes a file whose inode and first
bytes match the checkpoint.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from kvlens.records import Rejections, Validated
from kvlens.sources.jsonlines import records_from_lines
from kvlens.sources.jsonscan import FieldExtractor

log = logging.getLogger(__name__)

FINGERPRINT_BYTES: Final = 256
BATCH_BYTES: Final = 1024 * 1024
READ_BYTES: Final = 256 * 1024


@dataclass
class _Followed:
    path: str
    handle: IO[bytes]
    position: int  # next byte to read
    fingerprint: str  # sha256 of the first fingerprint_bytes bytes
    fingerprint_bytes: int
    pending: bytearray = field(default_factory=bytearray)  # a partial last line
    long: FieldExtractor | None = None  # inside an over-long line, until its newline
    long_start: int = 0  # where that line starts
    gone: bool = False  # no longer matched by the glob: read to its end, then closed

    @property
    def offset(self) -> int:
        """The start of the first line not yet handed on (what a restart resumes from)."""
        return self.long_start if self.long is not None else self.position - len(self.pending)

    def start_over(self) -> None:
        self.position = 0
        self.pending.clear()
        self.long = None


@dataclass
class Poll:
    lines: list[bytes]
    too_long: int  # over-long lines that were not JSON objects: skipped
    shortened: int  # over-long lines handed on as their small top-level fields
    more: bool  # the batch was full: more is waiting, poll again without sleeping


class Tailer:
    def __init__(self, pattern: str, checkpoint: Path, *, max_line_bytes: int = 1024 * 1024) -> None:
        self.pattern = pattern
        self.checkpoint_file = checkpoint
        self.max_line_bytes = max_line_bytes
        self._files: dict[tuple[int, int], _Followed] = {}
        self._resume = self._load_checkpoint()
        self.dirty = False  # state changed since the last checkpoint written

    def poll(self, max_bytes: int = BATCH_BYTES) -> Poll:
        """Lines completed since the last poll, across all matched files, about ``max_bytes``
        of them at most. Call :meth:`checkpoint` once they are counted."""
        lines: list[bytes] = []
        budget = [max_bytes]
        long_lines = [0, 0]  # too long, shortened
        seen: set[tuple[int, int]] = set()
        for path in sorted(glob.glob(self.pattern)):
            try:
                status = os.stat(path)
            except FileNotFoundError:
                continue
            key = (status.st_dev, status.st_ino)
            seen.add(key)
            followed = self._files.get(key) or self._open(path, key)
            if followed is None:
                continue
            followed.path = path
            followed.gone = False
            self._notice_rewrite(followed, status.st_size)
            if budget[0] > 0:
                self._read(followed, lines, budget, long_lines)
        for key, followed in list(self._files.items()):
            if key in seen:
                continue
            followed.gone = True  # renamed away or deleted: read to its end through the handle
            self._notice_rewrite(followed, os.fstat(followed.handle.fileno()).st_size)
            if budget[0] > 0:
                self._read(followed, lines, budget, long_lines)
                if budget[0] > 0:  # it reached its end
                    del self._files[key]
                    followed.handle.close()
                    self.dirty = True
        if lines or long_lines[0]:
            self.dirty = True
        return Poll(lines, long_lines[0], long_lines[1], more=budget[0] <= 0)

    def _notice_rewrite(self, followed: _Followed, size: int) -> None:
        """Start a file over when it was truncated, or truncated and written again past where we
        were (its first bytes changed), also after it was renamed away or deleted; then
        fingerprint the bytes it starts with now."""
        if size < followed.position or not _starts_as_before(followed):
            log.info("kvlens tail: %s was truncated; reading it from the start", followed.path)
            followed.start_over()
            followed.fingerprint_bytes = 0
            self.dirty = True
        if followed.fingerprint_bytes < min(size, FINGERPRINT_BYTES):
            followed.fingerprint_bytes = min(size, FINGERPRINT_BYTES)
            followed.fingerprint = _fingerprint(followed.handle, followed.fingerprint_bytes)

    def close(self) -> None:
        try:
            self.checkpoint()
        except OSError as error:
            log.warning("kvlens tail %s: last checkpoint not written: %s", self.pattern, type(error).__name__)
        for followed in self._files.values():
            followed.handle.close()
        self._files.clear()

    def _open(self, path: str, key: tuple[int, int]) -> _Followed | None:
        try:
            handle = open(path, "rb")  # noqa: SIM115 - held open while the file is followed
        except OSError as error:
            log.warning("kvlens tail: cannot open %s: %s", path, type(error).__name__)
            return None
        position = 0
        resumed = self._resume.pop(f"{key[0]}:{key[1]}", None)
        if resumed:
            length = int(resumed.get("fingerprint_bytes", 0))
            if _fingerprint(handle, length) == resumed.get("fingerprint"):
                position = int(resumed.get("offset", 0))
        length = min(os.fstat(handle.fileno()).st_size, FINGERPRINT_BYTES)
        followed = _Followed(path, handle, position, _fingerprint(handle, length), length)
        self._files[key] = followed
        return followed

    def _read(
        self, followed: _Followed, lines: list[bytes], budget: list[int], long_lines: list[int]
    ) -> None:
        """Read a file up to its end or the budget; complete lines go to ``lines``, and over-long
        ones are counted in ``long_lines`` (too long, shortened)."""
        limit = self.max_line_bytes
        followed.handle.seek(followed.position)
        while budget[0] > 0 and (chunk := followed.handle.read(min(READ_BYTES, budget[0]))):
            budget[0] -= len(chunk)
            followed.position += len(chunk)
            start = 0
            while (newline := chunk.find(b"\n", start)) >= 0:
                piece = chunk[start:newline]
                start = newline + 1
                if followed.long is not None:  # the end of an over-long line
                    followed.long.feed(piece)
                    self._long_line_done(followed.long, lines, long_lines)
                    followed.long = None
                    continue
                line = bytes(followed.pending) + piece if followed.pending else piece
                followed.pending.clear()
                if len(line) > limit:
                    extractor = FieldExtractor()
                    extractor.feed(line)
                    self._long_line_done(extractor, lines, long_lines)
                elif line.strip():
                    lines.append(line)
            rest = chunk[start:]
            if followed.long is not None:
                followed.long.feed(rest)
            else:
                followed.pending += rest
                if len(followed.pending) > limit:  # stream the rest of this line past an extractor
                    followed.long_start = followed.position - len(followed.pending)
                    followed.long = FieldExtractor()
                    followed.long.feed(bytes(followed.pending))
                    followed.pending.clear()

    @staticmethod
    def _long_line_done(extractor: FieldExtractor, lines: list[bytes], long_lines: list[int]) -> None:
        kept = extractor.finish()
        if kept is None:
            long_lines[0] += 1
        else:
            lines.append(kept)
            long_lines[1] += 1

    def _load_checkpoint(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.checkpoint_file.read_text())
            return {str(k): v for k, v in data.get("files", {}).items() if isinstance(v, dict)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as error:
            log.warning("kvlens tail: ignoring unreadable checkpoint %s: %s", self.checkpoint_file, error)
            return {}

    def checkpoint(self) -> None:
        """Write the offsets of everything read so far (call once it is counted); raises OSError."""
        if not self.dirty:
            return
        files = {
            f"{dev}:{ino}": {
                "path": f.path,
                "offset": f.offset,
                "fingerprint": f.fingerprint,
                "fingerprint_bytes": f.fingerprint_bytes,
            }
            for (dev, ino), f in self._files.items()
        }
        files.update({k: v for k, v in self._resume.items() if k not in files})  # not seen yet
        self.checkpoint_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.checkpoint_file.with_name(self.checkpoint_file.name + ".tmp")
        with open(temporary, "w") as out:
            json.dump({"version": 2, "pattern": self.pattern, "files": files}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.checkpoint_file)
        with contextlib.suppress(OSError):  # make the rename itself durable
            directory = os.open(self.checkpoint_file.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        self.dirty = False


def _starts_as_before(followed: _Followed) -> bool:
    """Whether the file still begins with the bytes it began with when last printed."""
    return _fingerprint(followed.handle, followed.fingerprint_bytes) == followed.fingerprint


def _fingerprint(handle: IO[bytes], length: int) -> str:
    """A hash of the file's first ``length`` bytes: tells a reused inode from the file checkpointed."""
    position = handle.tell()
    handle.seek(0)
    head = handle.read(length)
    handle.seek(position)
    return hashlib.sha256(head).hexdigest()


def checkpoint_path(state_dir: Path, pattern: str) -> Path:
    """One checkpoint file per glob, named by its hash."""
    return state_dir / f"tail-{hashlib.sha256(pattern.encode()).hexdigest()[:16]}.json"


class TailStatus:
    """Whether a tail's checkpoint is being written; said in the log once per change."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.checkpoint_ok = True
        self.checkpoint_failures = 0
        self.lines_shortened = 0  # over-long lines counted from their small top-level fields
        self.lines_ignored = 0  # lines that describe no request (streaming chunks before the last)
        self.problem: str | None = None
        self._lock = threading.Lock()

    def checkpoint_written(self) -> None:
        with self._lock:
            if not self.checkpoint_ok:
                log.warning("kvlens tail %s: checkpoints are written again", self.pattern)
            self.checkpoint_ok, self.problem = True, None

    def checkpoint_failed(self, error: OSError, where: Path) -> None:
        with self._lock:
            self.checkpoint_failures += 1
            if self.checkpoint_ok:
                log.warning(
                    "kvlens tail %s: cannot write its checkpoint in %s (%s); lines are still counted, "
                    "but a restart would read them again: give state_dir a writable volume",
                    self.pattern,
                    where.parent,
                    type(error).__name__,
                )
            self.checkpoint_ok = False
            reason = type(error).__name__
            self.problem = f"tail {self.pattern}: checkpoint in {where.parent} cannot be written ({reason})"


def follow(
    tailer: Tailer,
    convert: Callable[[Any], Any],
    deliver: Callable[[Validated], None],
    stop: threading.Event,
    poll_seconds: float,
    status: TailStatus | None = None,
) -> None:
    """Poll until ``stop`` is set: each batch of lines goes to ``deliver``, then to the checkpoint."""
    status = status or TailStatus(tailer.pattern)
    try:
        while True:
            more = False
            try:
                polled = tailer.poll()
                more = polled.more
                if polled.lines or polled.too_long:
                    skipped = Rejections.single([-1] * polled.too_long, "too_long")  # no line to point at
                    validated, ignored = records_from_lines(polled.lines, convert)
                    deliver(validated.with_rejections(skipped))
                    status.lines_ignored += ignored
                status.lines_shortened += polled.shortened
                try:
                    tailer.checkpoint()
                except OSError as error:
                    status.checkpoint_failed(error, tailer.checkpoint_file)
                else:
                    status.checkpoint_written()
            except OSError as error:  # a vanished directory
                log.warning("kvlens tail %s: %s", tailer.pattern, type(error).__name__)
            except Exception:  # a bug must not end the following: log it and poll again
                log.exception("kvlens tail %s: poll failed", tailer.pattern)
            if stop.is_set() or (not more and stop.wait(poll_seconds)):
                return
    finally:
        tailer.close()
