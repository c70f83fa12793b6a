"""Follow JSON-lines files matched by a glob, as log shippers do, by polling.

A file is known by its device and inode, not its name, and kept open while it is followed, so:

- rename rotation: the renamed file is read to its end, the new file at the old name from 0;
- delete and recreate: the deleted file is read to its end through the open descriptor;
- truncation and copytruncate: a file shorter than the offset is read again from 0 (lines
  written between the copy and the truncation are lost, as with every shipper);
- a partial last line waits for its newline and is counted once;
- a line longer than ``max_line_bytes`` is skipped (and counted) up to its newline.

The glob must not match rotated copies (``app.log.1``), or they would be read as new files.

Offsets are checkpointed to a JSON file written atomically (temporary file, fsync, rename)
**before** the lines read are handed on: a crash loses at most one poll of lines and never
counts a line twice. A restart resumes a file whose inode and first bytes match the checkpoint.
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
from typing import IO, Any

from kvlens.records import Rejections, Validated
from kvlens.sources.jsonlines import records_from_lines

log = logging.getLogger(__name__)

FINGERPRINT_BYTES = 256
READ_CHUNK = 4 * 1024 * 1024


@dataclass
class _Followed:
    path: str
    handle: IO[bytes]
    position: int  # next byte to read
    fingerprint: str  # sha256 of the first fingerprint_bytes bytes
    fingerprint_bytes: int
    pending: bytearray = field(default_factory=bytearray)  # a partial last line
    skipping: bool = False  # inside an over-long line, until its newline

    @property
    def offset(self) -> int:
        """Just after the last complete line handed on (what a restart resumes from)."""
        return self.position - len(self.pending)


@dataclass
class Poll:
    lines: list[bytes]
    too_long: int  # lines skipped for their length


class Tailer:
    def __init__(self, pattern: str, checkpoint: Path, *, max_line_bytes: int = 1024 * 1024) -> None:
        self.pattern = pattern
        self.checkpoint = checkpoint
        self.max_line_bytes = max_line_bytes
        self._files: dict[tuple[int, int], _Followed] = {}
        self._resume = self._load_checkpoint()

    def poll(self) -> Poll:
        """Lines completed since the last poll, across all matched files; checkpoints first."""
        lines: list[bytes] = []
        too_long = 0
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
            if status.st_size < followed.position or not _starts_as_before(followed):
                # truncated, or truncated and written again past where we were: start over
                log.info("kvlens tail: %s was truncated; reading it from the start", path)
                followed.position = 0
                followed.pending.clear()
                followed.skipping = False
                followed.fingerprint_bytes = 0
            if followed.fingerprint_bytes < min(status.st_size, FINGERPRINT_BYTES):
                followed.fingerprint_bytes = min(status.st_size, FINGERPRINT_BYTES)
                followed.fingerprint = _fingerprint(followed.handle, followed.fingerprint_bytes)
            too_long += self._read(followed, lines)
        for key in [k for k in self._files if k not in seen]:  # renamed away or deleted
            followed = self._files.pop(key)
            too_long += self._read(followed, lines)
            followed.handle.close()
        if lines or too_long:
            self._write_checkpoint()
        return Poll(lines, too_long)

    def close(self) -> None:
        self._write_checkpoint()
        for followed in self._files.values():
            followed.handle.close()
        self._files.clear()

    def _open(self, path: str, key: tuple[int, int]) -> _Followed | None:
        try:
            handle = open(path, "rb")  # noqa: SIM115 - held open while the file is followed
        except OSError as error:
            log.warning("kvlens tail: cannot open %s: %s", path, error)
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

    def _read(self, followed: _Followed, lines: list[bytes]) -> int:
        """Read to the end of a file; complete lines go to ``lines``. Returns lines skipped."""
        too_long = 0
        limit = self.max_line_bytes
        followed.handle.seek(followed.position)
        while chunk := followed.handle.read(READ_CHUNK):
            followed.position += len(chunk)
            start = 0
            while (newline := chunk.find(b"\n", start)) >= 0:
                piece = chunk[start:newline]
                start = newline + 1
                if followed.skipping:  # the end of an over-long line
                    followed.skipping = False
                    continue
                line = bytes(followed.pending) + piece if followed.pending else piece
                followed.pending.clear()
                if len(line) > limit:
                    too_long += 1
                elif line.strip():
                    lines.append(line)
            if not followed.skipping:
                followed.pending += chunk[start:]
                if len(followed.pending) > limit:
                    followed.pending.clear()
                    followed.skipping = True
                    too_long += 1
        return too_long

    def _load_checkpoint(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.checkpoint.read_text())
            return {str(k): v for k, v in data.get("files", {}).items() if isinstance(v, dict)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as error:
            log.warning("kvlens tail: ignoring unreadable checkpoint %s: %s", self.checkpoint, error)
            return {}

    def _write_checkpoint(self) -> None:
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
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        with open(temporary, "w") as out:
            json.dump({"version": 1, "pattern": self.pattern, "files": files}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.checkpoint)
        with contextlib.suppress(OSError):  # make the rename itself durable
            directory = os.open(self.checkpoint.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)


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


def follow(
    tailer: Tailer,
    convert: Callable[[Any], Any],
    deliver: Callable[[Validated], None],
    stop: threading.Event,
    poll_seconds: float,
) -> None:
    """Poll until ``stop`` is set; each poll's lines go to ``deliver`` as one validated batch."""
    try:
        while True:
            try:
                polled = tailer.poll()
            except OSError as error:  # a vanished directory, a full disk for the checkpoint
                log.warning("kvlens tail %s: %s", tailer.pattern, error)
            except Exception:  # a bug must not end the following: log it and poll again
                log.exception("kvlens tail %s: poll failed", tailer.pattern)
            else:
                if polled.lines or polled.too_long:
                    skipped = Rejections.single([-1] * polled.too_long, "too_long")  # no line to point at
                    deliver(records_from_lines(polled.lines, convert).with_rejections(skipped))
            if stop.wait(poll_seconds):
                return
    finally:
        tailer.close()
