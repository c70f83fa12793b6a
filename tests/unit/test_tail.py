"""Following files through what log rotation does to them; checkpoints across restarts."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvlens.records import Validated
from kvlens.sources.formats import converter
from kvlens.sources.tail import STUCK_SECONDS, Tailer, TailStatus, follow


def line(i: int) -> bytes:
    return json.dumps({"prompt_tokens": 100 + i, "cached_tokens": i % 3}).encode() + b"\n"


def append(path: Path, *numbers: int) -> None:
    with open(path, "ab") as out:
        out.write(b"".join(line(i) for i in numbers))


def numbers(lines: list[bytes]) -> list[int]:
    return [json.loads(raw)["prompt_tokens"] - 100 for raw in lines]


def new_tailer(tmp_path: Path) -> Tailer:
    tailer = Tailer(str(tmp_path / "logs" / "*.log"), tmp_path / "state" / "tail.json", max_line_bytes=4096)
    _open_tailers.append(tailer)
    return tailer


_open_tailers: list[Tailer] = []


@pytest.fixture(autouse=True)
def close_tailers() -> Iterator[None]:
    yield
    while _open_tailers:
        _open_tailers.pop().close()


def setup(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    return tmp_path / "logs" / "app.log"


def test_reads_appended_lines_once(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0, 1)
    tailer = new_tailer(tmp_path)
    assert numbers(tailer.poll().lines) == [0, 1]
    assert tailer.poll().lines == []
    append(log, 2)
    assert numbers(tailer.poll().lines) == [2]


def test_partial_last_line_is_counted_once_when_complete(tmp_path: Path) -> None:
    log = setup(tmp_path)
    whole = line(7)
    log.write_bytes(whole[:10])
    tailer = new_tailer(tmp_path)
    assert tailer.poll().lines == []
    with open(log, "ab") as out:
        out.write(whole[10:])
    assert numbers(tailer.poll().lines) == [7]
    assert tailer.poll().lines == []


def test_rename_rotation(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    tailer = new_tailer(tmp_path)
    assert numbers(tailer.poll().lines) == [0]
    append(log, 1)  # written before the rotation, not yet read
    log.rename(tmp_path / "logs" / "app.log.1")  # out of the glob
    append(log, 2)
    assert sorted(numbers(tailer.poll().lines)) == [1, 2]
    append(log, 3)
    assert numbers(tailer.poll().lines) == [3]


def test_delete_and_recreate(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    tailer = new_tailer(tmp_path)
    tailer.poll()
    append(log, 1)
    log.unlink()
    assert numbers(tailer.poll().lines) == [1]  # read to the end through the open descriptor
    append(log, 2)
    assert numbers(tailer.poll().lines) == [2]


def test_copytruncate_and_truncation(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0, 1, 2)
    tailer = new_tailer(tmp_path)
    tailer.poll()
    (tmp_path / "logs" / "app.log.1").write_bytes(log.read_bytes())  # the copy, outside the glob
    with open(log, "r+b") as out:
        out.truncate(0)
    append(log, 3)
    assert numbers(tailer.poll().lines) == [3]


def test_a_file_truncated_rewritten_and_deleted_between_polls_is_read_whole(tmp_path: Path) -> None:
    """Found by the stateful test: the deleted file is drained through its handle, and its rewrite
    (same length as before, so only its first bytes tell) must be noticed there too."""
    log = setup(tmp_path)
    tailer = new_tailer(tmp_path)
    append(log, 0)
    assert numbers(tailer.poll().lines) == [0]
    with open(log, "r+b") as out:
        out.truncate(0)
    append(log, 1)
    log.unlink()
    assert numbers(tailer.poll().lines) == [1]


def test_an_over_long_object_is_handed_on_as_its_small_fields(tmp_path: Path) -> None:
    log = setup(tmp_path)
    prompt = json.dumps({"text": "y" * 10_000})  # a field kvlens does not read, over the limit
    long = json.dumps({"prompt_tokens": 109, "request_parameters": prompt, "cached_tokens": 1})
    with open(log, "ab") as out:
        out.write(line(0) + long.encode() + b"\n" + b'"' + b"z" * 10_000 + b'"\n' + line(1))
    polled = new_tailer(tmp_path).poll()
    assert numbers(polled.lines) == [0, 9, 1]  # in file order
    assert json.loads(polled.lines[1]) == {"prompt_tokens": 109, "cached_tokens": 1}
    assert (polled.shortened, polled.too_long) == (1, 1)  # the string line is no object


def test_an_over_long_line_is_counted_once_when_it_ends(tmp_path: Path) -> None:
    log = setup(tmp_path)
    tailer = new_tailer(tmp_path)
    log.write_bytes(b'{"prompt_tokens": 104, "cached_tokens": 1, "pad": "' + b"y" * 5000)
    polled = tailer.poll()
    assert (polled.lines, polled.too_long, polled.shortened) == ([], 0, 0)  # not over yet
    with open(log, "ab") as out:
        out.write(b'"}\n')
    polled = tailer.poll()
    assert numbers(polled.lines) == [4] and polled.shortened == 1
    append(log, 5)
    assert numbers(tailer.poll().lines) == [5]


def test_a_restart_inside_an_over_long_line_reads_it_again_from_its_start(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    with open(log, "ab") as out:
        out.write(b'{"prompt_tokens": 107, "cached_tokens": 7, "pad": "' + b"y" * 5000)
    first = new_tailer(tmp_path)
    assert numbers(first.poll().lines) == [0]
    first.close()  # the checkpoint points at the long line's start: nothing of it was counted
    with open(log, "ab") as out:
        out.write(b'"}\n')
    append(log, 8)
    polled = new_tailer(tmp_path).poll()
    assert numbers(polled.lines) == [7, 8] and polled.shortened == 1


def test_restart_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0, 1)
    first = new_tailer(tmp_path)
    assert numbers(first.poll().lines) == [0, 1]
    first.close()
    append(log, 2)
    second = new_tailer(tmp_path)
    assert numbers(second.poll().lines) == [2]  # neither 0 nor 1 again


def test_restart_after_the_file_was_replaced_reads_the_new_one_whole(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0, 1)
    first = new_tailer(tmp_path)
    first.poll()
    first.close()
    log.unlink()
    append(log, 8, 9)  # may even reuse the inode: the fingerprint tells them apart
    assert numbers(new_tailer(tmp_path).poll().lines) == [8, 9]


def test_checkpoint_is_written_atomically(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    tailer = new_tailer(tmp_path)
    tailer.poll()
    checkpoint = tmp_path / "state" / "tail.json"
    assert not checkpoint.exists()  # not before the lines read are counted
    tailer.checkpoint()
    saved = json.loads(checkpoint.read_text())
    (entry,) = saved["files"].values()
    assert entry["offset"] == len(line(0))
    assert not (tmp_path / "state" / "tail.json.tmp").exists()


def test_unreadable_checkpoint_starts_over(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "tail.json").write_text("{not json")
    assert numbers(new_tailer(tmp_path).poll().lines) == [0]


def test_a_path_that_turned_into_a_fifo_after_its_stat_is_opened_without_blocking(tmp_path: Path) -> None:
    # what poll() does after os.stat said "regular file": a FIFO put there since must not block
    log = setup(tmp_path)
    os.mkfifo(log)
    skip = new_tailer(tmp_path)._open(str(log))
    assert not isinstance(skip, tuple) and skip.reason == "fifo"


def test_skipped_paths_are_counted_once_until_they_change(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    other = tmp_path / "logs" / "other.log"
    other.mkdir()
    tailer = new_tailer(tmp_path)
    first = tailer.poll()
    assert numbers(first.lines) == [0] and first.skipped == {"directory": 1} and first.unreadable == {}
    assert tailer.poll().skipped == {}  # the same directory: neither counted nor said again
    other.rmdir()
    other.symlink_to(other)
    assert tailer.poll().skipped == {"unreadable": 1}
    assert tailer.poll().unreadable == {str(other): "OSError"}  # still unreadable: still reported
    other.unlink()
    assert tailer.poll().unreadable == {}


def test_a_round_that_does_not_come_back_fails_readiness(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    now = [0.0]
    status = TailStatus("logs", clock=lambda: now[0])
    delivering, release = threading.Event(), threading.Event()

    def deliver(validated: Validated) -> None:  # a round that hangs, as on a mount that stopped answering
        delivering.set()
        release.wait(10)

    stop = threading.Event()
    thread = threading.Thread(
        target=follow, args=(new_tailer(tmp_path), converter("kvlens"), deliver, stop, 0.01, status)
    )
    thread.start()
    try:
        assert delivering.wait(10)
        now[0] = STUCK_SECONDS
        assert status.problems() == []  # not past the deadline yet
        now[0] = STUCK_SECONDS + 1
        assert status.problems() == [
            f"tail logs: a poll has not come back for {STUCK_SECONDS + 1:.0f} s "
            "(a file system that does not answer?)"
        ]
    finally:
        stop.set()
        release.set()
        thread.join(10)
    assert not thread.is_alive()
    assert status.problems() == []


def test_a_fifo_in_place_of_the_checkpoint_fails_the_write_without_blocking(tmp_path: Path) -> None:
    log = setup(tmp_path)
    append(log, 0)
    (tmp_path / "state").mkdir()
    os.mkfifo(tmp_path / "state" / "tail.json.tmp")  # an open for writing would wait for a reader
    tailer = new_tailer(tmp_path)
    tailer.poll()
    with pytest.raises(OSError):
        tailer.checkpoint()
    (tmp_path / "state" / "tail.json.tmp").unlink()
    tailer.checkpoint()
    assert json.loads((tmp_path / "state" / "tail.json").read_text())["files"]


class RotatingLog(RuleBasedStateMachine):
    """Writes, rotations, deletions, truncations, restarts and polls in any order: no line is
    read twice, and every line is read unless it was lost the way polling loses lines (its file
    removed or truncated before a poll saw it, or removed across a restart)."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp())
        (self.directory / "logs").mkdir()
        self.log = self.directory / "logs" / "app.log"
        self.tailer = new_tailer(self.directory)
        self.written: list[int] = []
        self.read: list[int] = []
        self.lost = False
        self.unread = False  # lines written since the last poll
        self.seen = False  # the current tailer has opened the current app.log
        self.removed_since_poll = False
        self.rotations = 0

    @rule(count=st.integers(1, 5))
    def write(self, count: int) -> None:
        if not self.log.exists():
            self.seen = False
        start = len(self.written)
        append(self.log, *range(start, start + count))
        self.written.extend(range(start, start + count))
        self.unread = True

    def _remove(self) -> None:
        if self.unread and not self.seen:
            self.lost = True
        self.removed_since_poll = True

    @rule()
    def rotate(self) -> None:
        if self.log.exists():
            self._remove()
            self.rotations += 1
            self.log.rename(self.directory / "logs" / f"app.log.{self.rotations}")

    @rule()
    def delete(self) -> None:
        if self.log.exists():
            self._remove()
            self.log.unlink()

    @rule()
    def truncate(self) -> None:
        if self.log.exists():
            self.lost |= self.unread
            with open(self.log, "r+b") as out:
                out.truncate(0)

    @rule()
    def poll(self) -> None:
        self.read.extend(numbers(self.tailer.poll().lines))
        self.unread = False
        self.removed_since_poll = False
        self.seen = self.log.exists()

    @rule()
    def restart(self) -> None:
        self.lost |= self.removed_since_poll and self.unread
        self.tailer.close()
        self.tailer = new_tailer(self.directory)
        self.seen = False

    @invariant()
    def read_at_most_once(self) -> None:
        assert len(self.read) == len(set(self.read))
        assert set(self.read) <= set(self.written)

    def teardown(self) -> None:
        self.read.extend(numbers(self.tailer.poll().lines))
        if not self.lost:
            assert sorted(self.read) == self.written
        self.tailer.close()
        shutil.rmtree(self.directory)


RotatingLog.TestCase.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)
test_rotating_log = RotatingLog.TestCase
