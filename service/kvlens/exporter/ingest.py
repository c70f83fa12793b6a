"""What an ingest request goes through before its records are counted, each step bounded. Its
body arrives and is admitted by the shared pieces of :mod:`kvlens.http.bodies` (``ArrivingBodies``,
``BodyReader``, ``IngestGate``); then:

- :class:`IngestWorker`: one thread decodes and counts, one request at a time, off the event loop,
  so memory is one request's working set however many arrive.
- :class:`BatchLedger`: ``kvlens-batch-id``s of committed batches, so a batch retried after a lost
  answer counts once; a retry of a batch still in progress is told to retry later.
- :class:`RecentRecords`: the optional de-duplication of records by request id and content.
- :class:`LogThrottle`: at most one line per interval for an event a client can repeat at will.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from kvlens.records import RecordBatch

T = TypeVar("T")


class IngestWorker:
    """One thread that decodes and counts ingest requests in arrival order."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlens-ingest")

    async def run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class BatchLedger:
    """Committed batch ids (compared by a 128-bit BLAKE2 digest of the whole id) with the short
    answer they got, the oldest forgotten past ``capacity``; and the ids in progress.

    Memory: about 130 bytes per remembered id (the digest, the answer's counts, the entry)."""

    NEW, IN_PROGRESS = "new", "in progress"

    def __init__(self, capacity: int) -> None:
        self._committed: OrderedDict[bytes, tuple[int, int, int, int]] = OrderedDict()
        self._in_progress: set[bytes] = set()
        self._capacity = capacity
        self._lock = threading.Lock()

    @staticmethod
    def key(batch_id: str) -> bytes:
        return hashlib.blake2b(batch_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def begin(self, key: bytes) -> str | tuple[int, int, int, int]:
        """NEW (now in progress), IN_PROGRESS (another attempt holds it), or the committed answer."""
        with self._lock:
            answer = self._committed.get(key)
            if answer is not None:
                return answer
            if key in self._in_progress:
                return self.IN_PROGRESS
            self._in_progress.add(key)
            return self.NEW

    def commit(self, key: bytes, answer: tuple[int, int, int, int]) -> None:
        with self._lock:
            self._in_progress.discard(key)
            if self._capacity:
                self._committed[key] = answer
                while len(self._committed) > self._capacity:
                    self._committed.popitem(last=False)

    def abandon(self, key: bytes) -> None:
        """The attempt failed: the batch may come again and will then be counted."""
        with self._lock:
            self._in_progress.discard(key)


class RecentRecords:
    """The last ``capacity`` records that carried a request_id, by a 64-bit hash of the id and
    every measured value; a record seen again within the window is a duplicate.

    The values are part of the key because vLLM's n>1 children share their parent's request_id
    (reference/engines.md section 4): they differ in what they measured, a replay does not.
    Memory: about 60 bytes per remembered record. Used from the ingest worker's thread only."""

    def __init__(self, capacity: int) -> None:
        self._seen: set[int] = set()
        self._order: deque[int] = deque()
        self._capacity = capacity

    def fresh(self, batch: RecordBatch) -> np.ndarray:
        """A mask of the records to count; those it keeps are remembered."""
        keep = np.ones(len(batch), bool)
        durations = (
            batch.queue_seconds,
            batch.prefill_seconds,
            batch.ttft_seconds,
            batch.decode_seconds,
            batch.e2e_seconds,
        )  # absent ones are NaN, which hashes by identity: made None
        columns = (
            batch.prompt_tokens.tolist(),
            batch.cached_tokens.tolist(),
            batch.output_tokens.tolist(),
            *([None if v != v else v for v in column.tolist()] for column in durations),
        )
        models = [batch.model_names[code] if code >= 0 else None for code in batch.model_codes.tolist()]
        for i, request_id in enumerate(batch.request_id):
            if request_id is None:
                continue
            key = hash((request_id, models[i], batch.replica[i], *(column[i] for column in columns)))
            if key in self._seen:
                keep[i] = False
                continue
            self._seen.add(key)
            self._order.append(key)
            if len(self._order) > self._capacity:
                self._seen.discard(self._order.popleft())
        return keep


class LogThrottle:
    """At most one line per ``interval`` seconds; :meth:`allow` says how many were held back since
    the last line that went out, or None when this one must be held back too."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self._interval = interval
        self._clock = clock
        self._next = -float("inf")
        self._held = 0

    def allow(self) -> int | None:
        now = self._clock()
        if now < self._next:
            self._held += 1
            return None
        held, self._held = self._held, 0
        self._next = now + self._interval
        return held
