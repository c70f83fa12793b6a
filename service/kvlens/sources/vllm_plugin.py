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

It needs only the standard library: installing kvlens into vLLM's image adds no other package
(the sidecar's packages are the ``serve`` extra).

Environment (read once, by :func:`plugin_settings`; a value that does not parse is logged, in one
line naming the variable, and replaced by its default: a typo never stops vLLM):

==================================  ==========================================  =========
``KVLENS_PLUGIN_ENABLED``           ``0``/``false``/``no``/``off`` turns the     ``1``
                                    plugin off (vLLM's ``VLLM_PLUGINS`` also
                                    filters plugins by name)
``KVLENS_PLUGIN_URL``               where to POST (an http(s) URL; otherwise     local
                                    the plugin turns itself off, logged)         sidecar
``KVLENS_PLUGIN_TOKEN``             bearer token for the sidecar's ingest        none
``KVLENS_PLUGIN_FILE``              append JSONL there instead of POSTing        none
``KVLENS_PLUGIN_QUEUE``             records held while the sidecar is away       100000
``KVLENS_PLUGIN_BATCH``             records per POST                             1000
``KVLENS_PLUGIN_FLUSH_SECONDS``     longest wait before a partial batch goes     1
``KVLENS_PLUGIN_TIMEOUT_SECONDS``   deadline of one whole POST                   10
==================================  ==========================================  =========
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import http.client
import json
import logging
import math
import operator
import os
import socket
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvlens.limits import DEFAULT_PORT

log = logging.getLogger("kvlens.vllm_plugin")

SOURCE = "vllm_plugin"
SOURCE_HEADER = "kvlens-source"
DROPPED_HEADER = "kvlens-dropped"
BATCH_HEADER = "kvlens-batch-id"
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}/v1/records"

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


def _json_value(value: Any) -> Any:
    """A field as JSON can hold it: a numpy scalar as its Python number, NaN or infinity as None
    (JSON has no word for them; the field is left out, as if the engine had not reported it)."""
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def encode_records(records: list[dict[str, Any]]) -> tuple[list[bytes], int]:
    """Each record as JSON; one that cannot be encoded is left out, and counted (the second
    value), so that it never holds back the records beside it."""
    encoded = []
    for record in records:
        try:
            fields = {
                key: plain for key, value in record.items() if (plain := _json_value(value)) is not None
            }
            encoded.append(json.dumps(fields, separators=(",", ":"), allow_nan=False).encode())
        except (TypeError, ValueError) as error:
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


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """What the environment asks of the plugin (see the module docstring)."""

    enabled: bool = True
    url: str = DEFAULT_URL
    token: str | None = None
    file: str | None = None
    queue: int = 100_000
    batch: int = 1000
    flush_seconds: float = 1.0
    timeout_seconds: float = 10.0


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "")


def plugin_settings(environ: Mapping[str, str]) -> PluginSettings:
    """The plugin's settings from ``environ``. Never raises: it runs inside vLLM's start-up, so a
    value that does not parse is logged once, naming the variable, and its default is used."""
    defaults = PluginSettings()
    numbers: dict[str, Any] = {}
    for field, kind in (("queue", int), ("batch", int), ("flush_seconds", float), ("timeout_seconds", float)):
        name = f"KVLENS_PLUGIN_{field.upper()}"
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            log.error(
                "kvlens: %s=%r is not a positive %s; using %s",
                name,
                raw[:64],
                "integer" if kind is int else "number",
                getattr(defaults, field),
            )
            continue
        numbers[field] = value
    switch = environ.get("KVLENS_PLUGIN_ENABLED", "1").strip().lower()
    if switch not in _OFF + _ON:
        log.error(
            "kvlens: KVLENS_PLUGIN_ENABLED=%r is not one of 1/0, true/false, yes/no, on/off; on", switch[:64]
        )
    enabled = switch not in _OFF
    url = environ.get("KVLENS_PLUGIN_URL") or DEFAULT_URL
    file = environ.get("KVLENS_PLUGIN_FILE") or None
    if enabled and file is None and not _is_http_url(url):
        log.error("kvlens: KVLENS_PLUGIN_URL=%r is not an http(s) URL; the plugin sends nothing", url[:200])
        enabled = False
    if not enabled:
        log.info("kvlens: the plugin is off (KVLENS_PLUGIN_ENABLED or KVLENS_PLUGIN_URL); vLLM runs as usual")
    token = environ.get("KVLENS_PLUGIN_TOKEN") or None
    return PluginSettings(enabled=enabled, url=url, token=token, file=file, **numbers)


def _is_http_url(url: str) -> bool:
    try:
        parsed = urllib.parse.urlsplit(url)
        return parsed.scheme in ("http", "https") and bool(parsed.hostname) and (parsed.port or 1) > 0
    except ValueError:  # a port that is not a number
        return False


_shipper: Shipper | None = None
_shipper_lock = threading.Lock()


def shared_shipper(settings: PluginSettings | None = None) -> Shipper:
    """One shipper per process (vLLM builds one logger per data-parallel engine)."""
    global _shipper
    with _shipper_lock:
        if _shipper is None:
            settings = settings or plugin_settings(os.environ)
            sink: Sink = (
                FileSink(settings.file)
                if settings.file
                else HttpSink(settings.url, settings.token, deadline=settings.timeout_seconds)
            )
            _shipper = Shipper(
                sink,
                build=records_from_rows,
                capacity=settings.queue,
                batch_size=settings.batch,
                flush_seconds=settings.flush_seconds,
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
            settings = plugin_settings(os.environ)
            self._recorder = (
                RequestRecorder(shared_shipper(settings), served_model_name(vllm_config), str(engine_index))
                if settings.enabled
                else None
            )

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None and self._recorder is not None:
                self._recorder.record_finished(iteration_stats)

        def log_engine_initialized(self) -> None:
            if self._recorder is not None:
                log.info(
                    "kvlens: sending finished-request records (%s)", type(shared_shipper()._sink).__name__
                )

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
