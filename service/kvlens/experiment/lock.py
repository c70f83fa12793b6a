"""The lock of an experiment's out-dir (``.kvlens.lock``): ``flock`` on a file holding the
writer's pid and command, so that a second run into the folder is refused naming the first. The
kernel drops the lock of a process that died, so a stale file never blocks; ``flock`` is per
host (two machines sharing the folder over NFS are not kept apart)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from kvlens.experiment.protocol import ExperimentError


@contextlib.contextmanager
def locked(path: Path, command: str) -> Iterator[None]:
    """Hold ``flock`` on ``path`` (holding our pid and command) for the run; refuse when another
    process holds it, naming it."""
    try:
        # O_NOFOLLOW: the lock is truncated and written, which through a symlink would be done to
        # whatever file it names (and O_CREAT would create its target)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ExperimentError(
                f"cannot lock {path}: a symbolic link, not a regular file (remove it)"
            ) from None
        raise ExperimentError(f"cannot lock {path}: {error.strerror or error}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # /dev/zero, a FIFO: no pid to write in it
        os.close(fd)
        raise ExperimentError(f"cannot lock {path}: not a regular file")
    with os.fdopen(fd, "r+", errors="replace") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise ExperimentError(f"cannot lock {path}: {error.strerror or error}") from None
            pid, _, other = lock.read(4096).partition("\n")
            raise ExperimentError(
                f"{path.parent} is in use by another run (pid {shown(pid) or 'unknown'}: "
                f"{shown(other) or 'command unknown'}); wait for it to end, or stop it"
            ) from None
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(f"{os.getpid()}\n{command}\n")
            lock.flush()
        except OSError as error:
            raise ExperimentError(f"cannot lock {path}: {error.strerror or error}") from None
        yield  # closing the file releases the lock; the file stays (removing it would race)


# Of the lock holder's pid, and of its command, as shown: a real run's command (its resume
# command, placeholders for secrets) runs to several hundred characters and is shown whole.
MAX_HOLDER_CHARS = 1000


def shown(text: str) -> str:
    """The lock file's text as it may be printed: anyone may write that file, so no escape
    sequence or line break reaches the terminal, and no more than MAX_HOLDER_CHARS of it."""
    return "".join(char for char in text.strip() if char.isprintable())[:MAX_HOLDER_CHARS]
