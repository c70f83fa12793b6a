"""The fleet index's lock, which its holder hands to a waiting scrape between the slices of a
long operation (a clear of 10M blocks takes seconds)."""

from __future__ import annotations

import threading
from types import TracebackType

_get_ident = threading.get_ident


class IndexLock:
    """The index's lock (a ``threading.Lock``: ``with index.lock:``), which its holder can hand
    over between the slices of a long operation (:meth:`pause`): a scrape waiting for it then
    gets it at the next slice, not after a clear of 10M blocks (seconds). A plain lock released
    and taken again is no hand-over: the releasing thread, running, takes it back first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()  # for ``_waiting`` (an int += is no atomic step)
        self._waiting = 0  # threads blocked in acquire
        self._taken = threading.Event()  # a waiter got the lock (after a pause released it)
        self._owner: int | None = None

    def acquire(self) -> IndexLock:
        if not self._lock.acquire(False):
            self._wait()
        self._owner = _get_ident()
        return self

    def _wait(self) -> None:
        with self._count_lock:
            self._waiting += 1
        self._lock.acquire()
        with self._count_lock:
            self._waiting -= 1
        self._taken.set()

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    # ``with index.lock:`` is taken a KV events batch: the methods themselves, not a call more each
    __enter__ = acquire

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._owner = None
        self._lock.release()

    def pause(self) -> None:
        """Called by the holder between slices: a thread waiting for the lock now takes it (the
        holder waits until it has, at most a second: a waiter may have given up), then the
        holder takes it back when that one is done. Nothing when this thread does not hold it
        (the index fed without its lock: tests, offline) or nobody waits."""
        if not self._waiting or self._owner != threading.get_ident():
            return
        self._taken.clear()
        self.release()
        self._taken.wait(1.0)
        self.acquire()
