"""Follow JSON-lines files matched by a glob, as log shippers do, by polling.

A file is known by its device and inode, not its name, and kept open while it is followed, so:

- rename rotation: the renamed file is read to its end, the new file at the old name from 0;
- delete and recreate: the deleted file is read to its end through the open descriptor;
- truncation and copytruncate: a file shorter than the offset is read again from 0 (lines
  written between the copy and the truncation are lost, as with every shipper);
- a partial last line waits for its newline and is counted once;
- a line longer than ``max_line_bytes`` is not held whole: its small top-level fields are kept as
  it streams past (:class:`~kvlens.jsonscan.FieldExtractor`) and the line is counted from
  them (a "shortened" line), so SGLang's lines, whose ``request_parameters`` carry the whole
  prompt, are never lost to their size; a long line that is not a JSON object is skipped and
  counted as ``too_long``. Either way it is counted once, also across a restart in its middle.

The glob must not match rotated copies (``app.log.1``), or they would be read as new files.

Only regular files are followed. Anything else the glob matches (a directory, FIFO, socket or
device) is skipped; so is a path that cannot be opened or read. A file is opened with
``O_NONBLOCK`` and checked with ``fstat`` before it is read, so a FIFO that takes the place of a
file between the ``stat`` and the ``open`` cannot block the poll either (an ``open`` of a FIFO
without it waits for a writer, forever). Each skipped path is counted and logged once, and again
only when it turns into something else or was readable in between; a path that cannot be read
fails readiness while it lasts, since lines in it may be lost.

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
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from kvlens.jsonscan import FieldExtractor
from kvlens.records import Rejections, Validated
from kvlens.sources.jsonlines import records_from_lines

log = logging.getLogger(__name__)

FINGERPRINT_BYTES: Final = 256
# Why a matched path is not followed; ``unreadable``: it cannot be stat'ed, opened or read.
SKIP_REASONS: Final = ("directory", "fifo", "socket", "device", "other", "unreadable")
_KIND_NAMES: Final = {
    "directory": "a directory",
    "fifo": "a FIFO",
    "socket": "a socket",
    "device": "a device",
}
BATCH_BYTES: Final = 1024 * 1024
READ_BYTES: Final = 256 * 1024
# A round of a tail (poll, count, checkpoint) that runs longer is stuck, and readiness fails: a
# round reads at most BATCH_BYTES and nothing in it waits on a local file system (measured: a full
# round of 13,000 lines, 0.2 to 0.8 s on a busy 2-core machine), so a file system that stopped
# answering is what gets there.
STUCK_SECONDS: Final = 30.0


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
    skipped: dict[str, int] = field(default_factory=dict)  # paths newly skipped, by reason
    unreadable: dict[str, str] = field(default_factory=dict)  # matched paths not readable now: why


@dataclass(frozen=True)
class _Skip:
    """Why a matched path is skipped, and what it was: the same skip is logged and counted once."""

    reason: str
    detail: str  # the file type or the error, e.g. "PermissionError"
    identity: tuple[int, int] | None  # device and inode, when known


class Tailer:
    def __init__(self, pattern: str, checkpoint: Path, *, max_line_bytes: int = 1024 * 1024) -> None:
        self.pattern = pattern
        self.checkpoint_file = checkpoint
        self.max_line_bytes = max_line_bytes
        self._files: dict[tuple[int, int], _Followed] = {}
        self._resume = self._load_checkpoint()
        self.dirty = False  # state changed since the last checkpoint written
        self._skipping: dict[str, _Skip] = {}  # matched paths skipped in the last poll

    def poll(self, max_bytes: int = BATCH_BYTES) -> Poll:
        """Lines completed since the last poll, across all matched files, about ``max_bytes``
        of them at most. Call :meth:`checkpoint` once they are counted."""
        lines: list[bytes] = []
        budget = [max_bytes]
        long_lines = [0, 0]  # too long, shortened
        seen: set[tuple[int, int]] = set()
        skipping: dict[str, _Skip] = {}
        for path in sorted(glob.glob(self.pattern)):
            try:
                status = os.stat(path)
            except FileNotFoundError:  # gone since the glob, or a dangling symlink
                continue
            except OSError as error:  # a symlink loop, a directory we may not search
                skipping[path] = _Skip("unreadable", type(error).__name__, None)
                continue
            key = (status.st_dev, status.st_ino)
            followed = self._files.get(key)
            size = status.st_size
            if followed is None:
                kind = _kind(status.st_mode)
                if kind is not None:
                    skipping[path] = _Skip(kind, kind, key)
                    continue
                opened = self._open(path)
                if isinstance(opened, _Skip):
                    skipping[path] = opened
                    continue
                key, followed, size = opened  # what was opened, should the path have changed since
            seen.add(key)
            followed.path = path
            followed.gone = False
            try:
                self._notice_rewrite(followed, size)
                if budget[0] > 0:
                    self._read(followed, lines, budget, long_lines)
            except OSError as error:  # an I/O error: tried again next poll, from where it stopped
                skipping[path] = _Skip("unreadable", type(error).__name__, key)
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
        return Poll(
            lines,
            long_lines[0],
            long_lines[1],
            more=budget[0] <= 0,
            skipped=self._note_skips(skipping),
            unreadable={path: skip.detail for path, skip in skipping.items() if skip.reason == "unreadable"},
        )

    def _note_skips(self, skipping: dict[str, _Skip]) -> dict[str, int]:
        """Log each newly skipped path once and count it: a path skipped as it was at the last poll
        is neither (so a directory beside the logs is said once, not every poll)."""
        newly: dict[str, int] = {}
        for path, skip in skipping.items():
            if self._skipping.get(path) == skip:
                continue
            newly[skip.reason] = newly.get(skip.reason, 0) + 1
            if skip.reason == "unreadable":
                log.warning(
                    "kvlens tail %s: cannot read %s (%s); tried again every poll, not ready until it can be",
                    self.pattern,
                    path,
                    skip.detail,
                )
            else:
                log.warning(
                    "kvlens tail %s: not following %s: %s, not a regular file",
                    self.pattern,
                    path,
                    _KIND_NAMES.get(skip.reason, "not a file kvlens can read"),
                )
        self._skipping = skipping  # paths no longer matched or readable again are forgotten
        return newly

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

    def _open(self, path: str) -> tuple[tuple[int, int], _Followed, int] | _Skip:
        """Open a regular file to follow: its device and inode, its state and its size; or why not.

        ``O_NONBLOCK``: the path may have become a FIFO since it was stat'ed, and a blocking open
        would wait for a writer; ``fstat`` then says what was really opened. Reads of a regular
        file ignore the flag."""
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            return _Skip("unreadable", type(error).__name__, None)
        try:
            status = os.fstat(descriptor)
        except OSError as error:
            os.close(descriptor)
            return _Skip("unreadable", type(error).__name__, None)
        key = (status.st_dev, status.st_ino)
        kind = _kind(status.st_mode)
        if kind is not None:
            os.close(descriptor)
            return _Skip(kind, kind, key)
        if (followed := self._files.get(key)) is not None:  # renamed here since the stat: known
            os.close(descriptor)
            return key, followed, status.st_size
        handle = os.fdopen(descriptor, "rb")  # held open while the file is followed
        position = 0
        resumed = self._resume.pop(f"{key[0]}:{key[1]}", None)
        if resumed:
            length = int(resumed.get("fingerprint_bytes", 0))
            if _fingerprint(handle, length) == resumed.get("fingerprint"):
                position = int(resumed.get("offset", 0))
        length = min(status.st_size, FINGERPRINT_BYTES)
        followed = _Followed(path, handle, position, _fingerprint(handle, length), length)
        self._files[key] = followed
        return key, followed, status.st_size

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
        # O_NONBLOCK: a FIFO left at that name must fail the write, not wait for a reader forever
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC
        with os.fdopen(os.open(temporary, flags, 0o666), "w") as out:
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


def _kind(mode: int) -> str | None:
    """None for a regular file, the only kind followed; else the skip reason for the kind."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "other"


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
    """How a tail fares, for metrics and readiness: its checkpoint (said in the log once per
    change), the paths it skips, and whether its polls still come back.

    Readiness fails while the checkpoint cannot be written, while a matched path cannot be read
    (lines in it may be lost), and while one round of the tail (poll, count, checkpoint) has run
    longer than ``stuck_seconds``: nothing in a poll blocks on a local file system, so that is a
    file system that stopped answering (a hung network mount)."""

    def __init__(
        self,
        pattern: str,
        *,
        stuck_seconds: float = STUCK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pattern = pattern
        self.checkpoint_ok = True
        self.checkpoint_failures = 0
        self.lines_shortened = 0  # over-long lines counted from their small top-level fields
        self.lines_ignored = 0  # lines that describe no request (streaming chunks before the last)
        self.files_skipped = dict.fromkeys(SKIP_REASONS, 0)  # matched paths not followed, by reason
        self.problem: str | None = None  # the checkpoint's
        self._unreadable: Mapping[str, str] = {}  # matched paths not readable at the last poll: why
        self._stuck_seconds = stuck_seconds
        self._clock = clock
        self._round_began: float | None = None  # while a round runs
        self._lock = threading.Lock()

    def round_began(self) -> None:
        with self._lock:
            self._round_began = self._clock()

    def round_ended(self) -> None:
        with self._lock:
            self._round_began = None

    def polled(self, polled: Poll) -> None:
        with self._lock:
            for reason, count in polled.skipped.items():
                self.files_skipped[reason] += count
            self._unreadable = polled.unreadable
            self.lines_shortened += polled.shortened

    def problems(self) -> list[str]:
        """Why this tail cannot keep its promise now; none when it can."""
        with self._lock:
            found = [self.problem] if self.problem else []
            if self._unreadable:
                path = min(self._unreadable)
                others = len(self._unreadable) - 1
                found.append(
                    f"tail {self.pattern}: cannot read {path} ({self._unreadable[path]})"
                    + (f" and {others} other matched paths" if others else "")
                )
            if self._round_began is not None:
                running = self._clock() - self._round_began
                if running > self._stuck_seconds:
                    found.append(
                        f"tail {self.pattern}: a poll has not come back for {running:.0f} s "
                        "(a file system that does not answer?)"
                    )
            return found

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
            status.round_began()
            try:
                polled = tailer.poll()
                more = polled.more
                status.polled(polled)
                if polled.lines or polled.too_long:
                    skipped = Rejections.single([-1] * polled.too_long, "too_long")  # no line to point at
                    validated, ignored = records_from_lines(polled.lines, convert)
                    deliver(validated.with_rejections(skipped))
                    status.lines_ignored += ignored
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
            status.round_ended()
            if stop.is_set() or (not more and stop.wait(poll_seconds)):
                return
    finally:
        tailer.close()
