"""vLLM stat-logger plugin: per finished request, cached tokens and engine timings to the sidecar.

Registered under the entry-point group ``vllm.stat_logger_plugins``, so installing kvlens into
the vLLM image is the whole install. vLLM (0.12+) loads it in ``AsyncLLM`` and calls
``record()`` from its output-handler asyncio task, so ``record()`` only reads a few attributes
and appends a tuple to a bounded queue. A background thread batches by size and time and POSTs
them (a JSON array) to the sidecar, retrying with backoff, each attempt under a hard total
deadline (a sidecar that answers one byte a second cannot hold it). While the sidecar is down the
queue keeps the newest records and counts the oldest it drops; a record that cannot be encoded
(a field of a type JSON has no word for) is dropped alone and counted the same way; the count
reaches the sidecar with the next delivery (``kvlens_records_dropped_total``). At exit it flushes
for up to two seconds.

Fields come from ``IterationStats.finished_requests`` (``FinishedRequestStats``), read with
``getattr`` because vLLM calls them unstable: ``request_id`` (0.20+), ``num_prompt_tokens``,
``num_cached_tokens`` (0.13+; without it the plugin sends nothing, since every request would
look like a miss), ``queued_time``, ``prefill_time``, ``decode_time``, ``e2e_latency``,
``num_generation_tokens``, ``finish_reason``. TTFT is engine-side ``queued_time +
prefill_time``: it leaves out the frontend (tokenization, IPC, detokenization).

Importing this module imports neither vLLM nor anything heavy; the logger class is built on
first access (vLLM's entry-point loader does that), subclassing vLLM's ``StatLoggerBase``.

Environment: ``KVLENS_PLUGIN_URL`` (default ``http://127.0.0.1:9433/v1/records``),
``KVLENS_PLUGIN_TOKEN`` (bearer token), ``KVLENS_PLUGIN_FILE`` (append JSONL there instead of
POSTing), ``KVLENS_PLUGIN_QUEUE`` (records held while the sidecar is away, default 100000),
``KVLENS_PLUGIN_BATCH`` (records per POST, default 1000), ``KVLENS_PLUGIN_FLUSH_SECONDS``
(default 1), ``KVLENS_PLUGIN_TIMEOUT_SECONDS`` (deadline of one whole POST, default 10).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import http.client
import logging
import operator
import os
import socket
import threading
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import orjson

log = logging.getLogger("kvlens.vllm_plugin")

SOURCE = "vllm_plugin"
SOURCE_HEADER = "kvlens-source"
DROPPED_HEADER = "kvlens-dropped"
BATCH_HEADER = "kvlens-batch-id"
DEFAULT_URL = "http://127.0.0.1:9433/v1/records"

# (attribute on FinishedRequestStats, kvlens record field); request_id first, then numbers.
_FIELD_MAP = (
    ("request_id", "request_id"),
    ("num_prompt_tokens", "prompt_tokens"),
    ("num_cached_tokens", "cached_tokens"),
    ("num_generation_tokens", "output_tokens"),
    ("queued_time", "queue_seconds"),
    ("prefill_time", "prefill_seconds"),
    ("decode_time", "decode_seconds"),
    ("e2e_latency", "e2e_seconds"),
    ("finish_reason", "finish_reason"),
)
_ATTRIBUTES = tuple(attribute for attribute, _ in _FIELD_MAP)
_FIELDS = tuple(field for _, field in _FIELD_MAP)


class Sink(Protocol):
    def send(self, records: list[bytes], dropped: int, batch_id: str) -> None:
        """Deliver one batch of encoded records; raise on failure (the batch is retried with the
        same id, so the sidecar counts it once even when an earlier try reached it but its answer
        was lost)."""


class HttpSink:
    """POST to the sidecar with the standard library (nothing to install into vLLM's image)."""

    def __init__(self, url: str, token: str | None, deadline: float = 10.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError("KVLENS_PLUGIN_URL must be an http(s) URL")
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port
        self._path = parsed.path or "/v1/records"
        self._token = token
        self._deadline = deadline

    def send(self, records: list[bytes], dropped: int, batch_id: str) -> None:
        body = b"[" + b",".join(records) + b"]"
        connection_class = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        connection = connection_class(self._host, self._port, timeout=min(5.0, self._deadline))
        # http.client's timeout is per socket operation: a peer that drips its answer resets it with
        # every byte. The watchdog shuts the socket down at the deadline, which ends any read.
        watchdog = threading.Timer(self._deadline, _shut_down, args=(connection,))
        watchdog.daemon = True
        headers = {
            "content-type": "application/json",
            SOURCE_HEADER: SOURCE,
            DROPPED_HEADER: str(dropped),
            BATCH_HEADER: batch_id,
        }
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        watchdog.start()
        try:
            connection.request("POST", self._path, body=body, headers=headers)
            response = connection.getresponse()
            response.read()
        finally:
            watchdog.cancel()
            connection.close()
        if response.status >= 500 or response.status in (401, 408, 413, 429):
            raise ConnectionError(f"sidecar answered {response.status}")
        # 400 means nothing in the batch decoded: retrying the same bytes would not help.


def _shut_down(connection: http.client.HTTPConnection) -> None:
    sock = connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class FileSink:
    """Append the JSONL to a file (for ``kvlens analyze`` or a tailing sidecar)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def send(self, records: list[bytes], dropped: int, batch_id: str) -> None:
        with open(self._path, "ab") as out:
            out.write(b"".join(record + b"\n" for record in records))


def encode_records(records: list[dict[str, Any]]) -> tuple[list[bytes], int]:
    """Each record as JSON; one that cannot be encoded is left out, and counted (the second
    value), so that it never holds back the records beside it."""
    encoded = []
    for record in records:
        try:
            encoded.append(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY))
        except TypeError as error:
            log.warning("kvlens: a finished request could not be encoded (%s); dropped and counted", error)
    return encoded, len(records) - len(encoded)


class Shipper:
    """A bounded queue drained by a background thread into a :class:`Sink`."""

    def __init__(
        self,
        sink: Sink,
        *,
        build: Callable[[list[Any]], list[dict[str, Any]]] = list,
        capacity: int = 100_000,
        batch_size: int = 1000,
        flush_seconds: float = 1.0,
        max_backoff_seconds: float = 30.0,
    ) -> None:
        self._sink = sink
        self._build = build
        self._queue: collections.deque[Any] = collections.deque(maxlen=capacity)
        self._capacity = capacity
        self._batch_size = batch_size
        self._flush_seconds = flush_seconds
        self._max_backoff = max_backoff_seconds
        self.dropped = 0  # dropped and not yet reported to the sidecar
        self._dropped_lock = threading.Lock()
        self.delivered = 0
        self.failures = 0  # failed attempts to deliver
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlens-shipper", daemon=True)
        self._thread.start()

    def offer(self, record: Any) -> None:
        """Never blocks: when full, the oldest record is dropped (and counted)."""
        if len(self._queue) >= self._capacity:
            with self._dropped_lock:
                self.dropped += 1
        self._queue.append(record)
        if len(self._queue) == self._batch_size:
            self._wake.set()  # once per full batch; the thread drains what is beyond it

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued, for at most ``timeout`` seconds."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _take(self) -> list[Any]:
        batch: list[Any] = []
        queue = self._queue
        while queue and len(batch) < self._batch_size:
            batch.append(queue.popleft())
        return batch

    def _run(self) -> None:
        backoff = 0.0
        pending: list[Any] = []
        pending_dropped = 0  # the drops this batch reports, fixed with its id across retries
        batch_id = ""
        while True:
            stopping = self._stop.is_set()
            if not stopping and (backoff or len(self._queue) < self._batch_size):
                self._wake.wait(max(self._flush_seconds, backoff))
                self._wake.clear()
            if not pending:
                taken = self._take()
                pending, poisoned = encode_records(self._build(taken))
                with self._dropped_lock:
                    self.dropped += poisoned
                pending_dropped, batch_id = self.dropped, uuid.uuid4().hex
                if not pending and poisoned:
                    continue  # nothing left to send; the drops go with the next batch
            if not pending:
                if stopping:
                    return
                continue
            try:
                self._sink.send(pending, pending_dropped, batch_id)
            except Exception as error:
                self.failures += 1
                backoff = min(self._max_backoff, max(0.5, backoff * 2))
                log.warning("kvlens: delivery failed (%s); retrying in %.1f s", type(error).__name__, backoff)
                if stopping:
                    return
                continue
            with self._dropped_lock:
                self.dropped -= pending_dropped
            self.delivered += len(pending)
            pending = []
            backoff = 0.0


_shipper: Shipper | None = None
_shipper_lock = threading.Lock()


def shared_shipper() -> Shipper:
    """One shipper per process (vLLM builds one logger per data-parallel engine)."""
    global _shipper
    with _shipper_lock:
        if _shipper is None:
            path = os.environ.get("KVLENS_PLUGIN_FILE")
            sink: Sink = (
                FileSink(path)
                if path
                else HttpSink(
                    os.environ.get("KVLENS_PLUGIN_URL", DEFAULT_URL),
                    os.environ.get("KVLENS_PLUGIN_TOKEN"),
                    deadline=float(os.environ.get("KVLENS_PLUGIN_TIMEOUT_SECONDS", "10")),
                )
            )
            _shipper = Shipper(
                sink,
                build=records_from_rows,
                capacity=int(os.environ.get("KVLENS_PLUGIN_QUEUE", "100000")),
                batch_size=int(os.environ.get("KVLENS_PLUGIN_BATCH", "1000")),
                flush_seconds=float(os.environ.get("KVLENS_PLUGIN_FLUSH_SECONDS", "1")),
            )
            atexit.register(_shipper.close)
        return _shipper


def served_model_name(vllm_config: Any) -> str | None:
    name = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return name if isinstance(name, str) and name else None


class RequestRecorder:
    """What ``record()`` does, apart from vLLM's base class: a tuple of attributes per finished
    request onto the queue. Records are built and encoded later, on the shipper's thread."""

    def __init__(self, shipper: Shipper, model: str | None, replica: str) -> None:
        self._offer: Callable[[Any], None] = shipper.offer
        self._model = model
        self._replica = replica
        self._read: Callable[[Any], tuple[Any, ...]] | None = None
        self._usable: bool | None = None

    def record_finished(self, iteration_stats: Any) -> None:
        finished = getattr(iteration_stats, "finished_requests", None)
        if not finished:
            return
        if self._usable is None:
            self._check(finished[0])
        if not self._usable or self._read is None:
            return
        read, offer, model, replica = self._read, self._offer, self._model, self._replica
        for stats in finished:
            offer((model, replica, read(stats)))

    def _check(self, stats: Any) -> None:
        self._usable = hasattr(stats, "num_cached_tokens")
        if not self._usable:
            log.error(
                "kvlens: this vLLM does not report num_cached_tokens (needs 0.13 or newer); "
                "the plugin sends nothing rather than count every request as a miss"
            )
        elif all(hasattr(stats, attribute) for attribute in _ATTRIBUTES):
            self._read = operator.attrgetter(*_ATTRIBUTES)  # one C call per request
        else:  # older vLLM (request_id arrived in 0.20): read what there is
            self._read = lambda stats: tuple(getattr(stats, attribute, None) for attribute in _ATTRIBUTES)


def records_from_rows(rows: list[tuple[str | None, str, tuple[Any, ...]]]) -> list[dict[str, Any]]:
    """The queued tuples as kvlens records (on the shipper's thread)."""
    records = []
    for model, replica, values in rows:
        record = {field: value for field, value in zip(_FIELDS, values, strict=True) if value is not None}
        queued, prefill, reason = values[4], values[5], values[8]
        if queued is not None and prefill is not None:
            record["ttft_seconds"] = queued + prefill  # engine-side TTFT
        if reason is not None:
            record["finish_reason"] = str(reason).lower()
        if model is not None:
            record["model"] = model
        record["replica"] = replica
        records.append(record)
    return records


def _build_logger_class() -> type:
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase  # type: ignore[import-not-found]
    except ImportError:  # no vLLM here: the class still works, for tests and offline use
        StatLoggerBase = object

    class KVLensStatLogger(StatLoggerBase):  # type: ignore[misc]
        """Sends every finished request's record to the kvlens sidecar."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._recorder = RequestRecorder(
                shared_shipper(), served_model_name(vllm_config), str(engine_index)
            )

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None:
                self._recorder.record_finished(iteration_stats)

        def log_engine_initialized(self) -> None:
            log.info("kvlens: sending finished-request records (%s)", type(shared_shipper()._sink).__name__)

        def log(self) -> None:
            pass

        def record_sleep_state(self, is_awake: int, level: int) -> None:
            pass

    return KVLensStatLogger


def __getattr__(name: str) -> Any:
    if name == "KVLensStatLogger":
        cls = _build_logger_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
