"""A lean HTTP/1.1 client for the replay's streamed completions, on asyncio protocols.

Why not httpx here: the replay's promise is to send on time and to time the first token as it
arrives. Through httpx every SSE chunk wakes a coroutine through httpcore and anyio, and
httpcore's pool scans every connection for every request (quadratic in the number in flight), so
at a few hundred requests per second the client's own loop made the send lag and TTFT it was
measuring (``bench/replay.py``). Here a connection's ``data_received`` does the whole work of a
chunk as it arrives, with no task switch: h11 (sans-IO, the parser under httpcore and uvicorn)
decodes the HTTP/1.1 framing (``content-length``, ``chunked`` with extensions and trailers, or to
the close) and says whether the connection may be kept; this module splits the SSE lines, stamps
the arrival with ``time.perf_counter`` and parses each ``data:`` line with orjson; the request's
future resolves once, when the body ends. Idle keep-alive connections are kept on a stack (most
recently used first, so one that the server closed for idleness is the rarest one taken) and a
request finds one in O(1).

What it does not do, said so in the README: proxies from the environment (httpx's
``trust_env``), HTTP/2, redirects, compressed answers (``accept-encoding: identity`` is sent).
The runner's other calls (checks, resets, samples, ``/detokenize``) go through httpx within
the bounds of ``experiment/calls.py``. Credentials come in ``headers`` (the endpoint's
``authorization``); a URL's userinfo is never sent by this client.

Failures carry the reasons the records used with httpx: ``http_STATUS`` (with the server's
reason, :func:`error_message`, from at most ERROR_BODY_BYTES of its body read for at most
ERROR_BODY_SECONDS: a body may never end), ``timeout`` (the whole request, connection and
answer, took more than ``timeout`` seconds, or no connection within ``connect_timeout``; a
stream that trickles forever is a timeout too), ``transport_ConnectError``,
``transport_RemoteProtocolError`` (the server closed the connection before the body ended, or
h11 found the answer's framing broken, or a head past _HEAD_LIMIT bytes),
``transport_ReadError`` (the connection was reset), ``content_encoding`` (a compressed answer:
never inflated), and the stream's own:
``malformed_stream`` (a line that is not JSON, or a chunk of a shape not expected at any depth:
see :func:`read_chunk`), ``stream_error``, ``stream_ended_early``, ``no_tokens``, ``line_too_long``
(a line past MAX_LINE_BYTES), ``too_many_tokens`` (more chunks with text than ``max_tokens``).
A hostile server so holds neither the run nor the client's memory.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import h11
import orjson

from kvlens.sources import usage as usage_names

# A response head (or a chunk-size line, or trailers) longer than this is not an HTTP server we can
# time: h11 fails it instead of buffering it (its own default is 16 KiB).
_HEAD_LIMIT = 64 * 1024
# One line of an answer at most: vLLM's chunks are a few hundred bytes, its usage line smaller;
# a line past this (a server that never sends a newline) fails the request, not the memory.
MAX_LINE_BYTES: Final = 1024 * 1024
IDENTITY: Final = ("identity", "")  # content-encoding values of an answer that is not compressed
_IDENTITY_BYTES: Final = tuple(value.encode() for value in IDENTITY)


# An error answer's body is read for the server's reason, within these bounds; past them the
# request fails with what came. vLLM's error bodies are a few hundred bytes.
ERROR_BODY_BYTES: Final = 16 * 1024
ERROR_BODY_SECONDS: Final = 1.0
MAX_ERROR_MESSAGE_CHARS: Final = 200  # of the reason kept in a record and shown in a report


class Failed(Exception):
    """A request that produced no timing; ``reason`` goes into the record's ``error``, the
    server's own words (``message``, bounded and printable) into its ``error_message``."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.message = message


def error_message(body: bytes) -> str | None:
    """The server's reason for an error answer: the OpenAI error's ``message`` (vLLM, SGLang and
    ``kvlens simulate serve`` send ``{"error": {"message": ...}}``), else the body's first bytes
    as text; control and other unprintable characters dropped, white space as one space, at most
    MAX_ERROR_MESSAGE_CHARS characters. It goes into records and reports and is printed: it is
    the endpoint's text, so nothing in it can move a terminal's cursor or forge a line."""
    text = None
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        found = error.get("message") if isinstance(error, dict) else error
        text = found if isinstance(found, str) else decoded.get("message")
    if not isinstance(text, str):
        text = body[: MAX_ERROR_MESSAGE_CHARS * 4].decode("utf-8", "replace")
    kept = "".join(" " if char.isspace() else char for char in text if char.isprintable() or char.isspace())
    return " ".join(kept.split())[:MAX_ERROR_MESSAGE_CHARS] or None


@dataclass
class Exchange:
    """What one streamed completion produced, times on ``time.perf_counter``'s clock."""

    sent: float
    max_tokens: int | None = None  # a chunk with text past this many fails the request
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    usage: dict[str, Any] | None = None
    end: float = math.nan  # arrival of ``data: [DONE]``


_TEXT: Final = (str, type(None))
_COUNT: Final = (int, type(None))  # exactly: true and false are no token counts, 2.0 is none
_OBJECT: Final = (dict, type(None))


def _shaped(value: Any, kinds: tuple[type, ...]) -> Any:
    if type(value) not in kinds:
        raise Failed("malformed_stream")
    return value


def read_chunk(chunk: Any) -> tuple[bool, dict[str, Any] | None]:
    """Whether a decoded ``data:`` chunk carries text (a completion's ``text`` or a chat
    ``delta.content`` that is not empty), and its ``usage``. Every place read is checked for the
    JSON type it must hold (absent or null where a server may leave it out), so a chunk of any
    other shape, at any depth, is ``malformed_stream`` (``stream_error`` when it carries an
    ``error``), never an exception out of the connection's callback; keys not read are not looked
    at. Usage counts are checked for their type here, for their values by the client."""
    if type(chunk) is not dict:
        raise Failed("malformed_stream")
    if "error" in chunk:
        raise Failed("stream_error")
    text = False
    for choice in _shaped(chunk.get("choices", []), (list,)):
        if type(choice) is not dict:
            raise Failed("malformed_stream")
        delta = _shaped(choice.get("delta"), _OBJECT) or {}
        # each checked whatever the other holds: a shape is malformed wherever it is
        given, content = _shaped(choice.get("text"), _TEXT), _shaped(delta.get("content"), _TEXT)
        text = text or bool(given or content)
    usage = _shaped(chunk.get("usage"), _OBJECT)
    if usage is not None:  # the places kvlens.sources.usage reads, either API's names
        for name in (*usage_names.PROMPT, *usage_names.OUTPUT):
            _shaped(usage.get(name), _COUNT)
        for name in usage_names.DETAILS:
            details = _shaped(usage.get(name), _OBJECT)
            if details is not None:
                _shaped(details.get("cached_tokens"), _COUNT)
    return text, usage


# A request prepared once: its head as h11 checks and writes it, and its body. Kept as such (not
# as bytes) because h11 on each connection must see the request it sends to frame the answer.
Request = tuple[h11.Request, bytes]


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    def __init__(self, client: StreamClient) -> None:
        self._client = client
        self._transport: asyncio.Transport | None = None
        self._http = h11.Connection(h11.CLIENT, max_incomplete_event_size=_HEAD_LIMIT)
        # body bytes not yet split into SSE lines: grown in place (a line sent a byte per chunk
        # would be copied whole for every byte as bytes)
        self._lines = bytearray()
        self._exchange: Exchange | None = None
        self._future: asyncio.Future[Exchange] | None = None
        self._done = False  # ``[DONE]`` seen
        self._received = False  # any byte of the current answer arrived
        self._request: Request | None = None
        # an error answer: its status and the part of its body read so far (see _head)
        self._error: tuple[int, bytearray] | None = None
        self._error_timer: asyncio.TimerHandle | None = None
        self.reused = False
        self.closed = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # every chunk in this read arrived now
        if self._future is None or self._future.done():
            self._close()  # bytes nobody waits for (or a cancelled request's): not reusable
            return
        self._received = True
        self._http.receive_data(data)
        try:
            self._advance(now)
        except Failed as failure:
            self._fail(failure.reason)

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._client._forget(self)
        if self._future is None or self._future.done():
            return
        if self.reused and not self._received and self._request is not None:
            # A kept-alive connection the server closed for idleness just as we sent on it: the
            # request never reached an answer, so it goes once more on a fresh connection.
            future, exchange, self._future, self._exchange = self._future, self._exchange, None, None
            assert exchange is not None
            self._client._connect(self._request, exchange, future)
        elif self._error is not None:
            self._fail_with_error()  # the server closed an error answer: what came is its reason
        elif exc is None:
            # h11 ends a body to the close here, and fails a body cut short (or no answer at all).
            self._http.receive_data(b"")
            try:
                self._advance(time.perf_counter())
            except Failed as failure:
                self._fail(failure.reason)
            self._fail("transport_RemoteProtocolError")  # a no-op once the future is settled
        elif isinstance(exc, OSError):
            self._fail("transport_ReadError")
        else:
            self._fail("transport_RemoteProtocolError")

    # the exchange

    def start(self, request: Request, exchange: Exchange, future: asyncio.Future[Exchange]) -> None:
        self._exchange, self._future, self._request = exchange, future, request
        self._lines = bytearray()
        self._done = self._received = False
        self._error = None
        future.add_done_callback(self._settled)
        assert self._transport is not None
        head, body = request
        http = self._http
        # One write, so one send on the socket; send() returns None only for ConnectionClosed.
        self._transport.write(
            (http.send(head) or b"")
            + (http.send(h11.Data(data=body)) or b"")
            + (http.send(h11.EndOfMessage()) or b"")
        )

    def _settled(self, future: asyncio.Future[Exchange]) -> None:
        """The request ended from outside (its deadline, or cancelled) while this connection still
        serves it: the rest of the answer is not wanted, so the connection goes now (a silent
        server would otherwise hold it until the run ends)."""
        if self._future is future:
            self._future = self._exchange = None
            self._close()

    def _advance(self, now: float) -> None:
        """Take every event h11 can make of the bytes received so far."""
        http = self._http
        while True:
            try:
                event = http.next_event()
            except h11.RemoteProtocolError:
                raise Failed("transport_RemoteProtocolError") from None
            kind = type(event)
            if kind is h11.Data:
                if self._error is not None:
                    self._error_body(event.data)  # type: ignore[union-attr]
                    if self._error is None:  # read to its bound
                        return
                    continue
                self._feed(event.data, now)  # type: ignore[union-attr]
            elif event is h11.NEED_DATA:
                return
            elif kind is h11.Response:
                self._head(event)  # type: ignore[arg-type]
            elif kind is h11.EndOfMessage:
                if self._error is not None:
                    self._fail_with_error()
                else:
                    self._finish()
                return
            elif kind is not h11.InformationalResponse:  # 100 Continue: the real head follows
                raise Failed("transport_RemoteProtocolError")  # closed before any answer

    def _head(self, response: h11.Response) -> None:
        if response.status_code != 200:
            # Its body says why (a context too long, a model not served): read for the reason
            # within ERROR_BODY_BYTES and ERROR_BODY_SECONDS, then the connection closes.
            self._error = (response.status_code, bytearray())
            self._error_timer = asyncio.get_running_loop().call_later(
                ERROR_BODY_SECONDS, self._fail_with_error
            )
            return
        for name, value in response.headers:
            if name == b"content-encoding" and value.lower() not in _IDENTITY_BYTES:
                raise Failed("content_encoding")  # identity was asked for: a bomb is never inflated

    def _feed(self, data: bytes, now: float) -> None:
        """Split body bytes into SSE lines and take each ``data:`` line in."""
        if not data:
            return
        self._lines += data
        if b"\n" not in data:
            if len(self._lines) > MAX_LINE_BYTES:
                raise Failed("line_too_long")
            return
        held = len(self._lines)
        *lines, self._lines = self._lines.split(b"\n")
        # Lines are measured only when what was held could hold a long one (a read is ~64 KiB).
        if held > MAX_LINE_BYTES and (
            len(self._lines) > MAX_LINE_BYTES or any(len(line) > MAX_LINE_BYTES for line in lines)
        ):
            raise Failed("line_too_long")
        exchange = self._exchange
        assert exchange is not None
        for line in lines:
            if not line.startswith(b"data:") or self._done:
                continue  # blank separators, comments, event: lines; anything after [DONE]
            event = line[5:].strip()
            if event == b"[DONE]":
                self._done = True
                exchange.end = now
                continue
            try:
                text, usage = read_chunk(orjson.loads(event))
            except orjson.JSONDecodeError:
                raise Failed("malformed_stream") from None
            if text:
                if len(exchange.token_times) == exchange.max_tokens:
                    raise Failed("too_many_tokens")  # not followed forever: token_times stays bounded
                exchange.token_times.append(now)
            if usage is not None:
                exchange.usage = usage

    def _finish(self) -> None:
        """The body ended."""
        if self._lines.strip():  # the last line had no newline: it is a line all the same
            try:
                self._feed(b"\n", time.perf_counter())
            except Failed as failure:
                self._fail(failure.reason)
                return
        future, exchange = self._future, self._exchange
        self._future = self._exchange = None
        assert future is not None and exchange is not None
        if future.done():  # cancelled
            self._close()
            return
        if not self._done:
            self._close()
            future.set_exception(Failed("stream_ended_early"))
            return
        http = self._http
        # Kept only when both sides may go on (h11 reads connection: close and HTTP/1.0) and the
        # server sent nothing past this answer.
        if (
            not self.closed
            and http.our_state is h11.DONE
            and http.their_state is h11.DONE
            and not http.trailing_data[0]
        ):
            http.start_next_cycle()
            self.reused = True
            self._client._release(self)
        else:
            self._close()
        if not exchange.token_times:
            future.set_exception(Failed("no_tokens"))
        else:
            future.set_result(exchange)

    def _error_body(self, data: bytes) -> None:
        assert self._error is not None
        body = self._error[1]
        body += data[: ERROR_BODY_BYTES - len(body)]
        if len(body) >= ERROR_BODY_BYTES:
            self._fail_with_error()

    def _fail_with_error(self) -> None:
        """End an error answer's request with its status and the reason read so far."""
        if self._error is None:
            return
        (status, body), self._error = self._error, None
        if self._error_timer is not None:
            self._error_timer.cancel()
            self._error_timer = None
        future, self._future, self._exchange = self._future, None, None
        self._close()
        if future is not None and not future.done():
            future.set_exception(Failed(f"http_{status}", error_message(bytes(body))))

    def _fail(self, reason: str) -> None:
        future, self._future, self._exchange = self._future, None, None
        self._close()
        if future is not None and not future.done():
            future.set_exception(Failed(reason))

    def _close(self) -> None:
        if self._error_timer is not None:
            self._error_timer.cancel()
            self._error_timer = None
        self.closed = True
        self._client._forget(self)
        if self._transport is not None:
            self._transport.close()


def _expire(future: asyncio.Future[Exchange]) -> None:
    if not future.done():
        future.set_exception(Failed("timeout"))


class StreamClient:
    """POSTs JSON bodies to ``base_url`` and reads their SSE answers (see the module's note)."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        authority = parts.netloc.rpartition("@")[2]
        fixed = {
            "host": authority,
            "user-agent": "kvlens-replay",
            "accept": "text/event-stream",
            "accept-encoding": "identity",
            "content-type": "application/json",
            **{name.lower(): value for name, value in (headers or {}).items()},
        }
        self._fixed = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in fixed.items()]
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._connecting: set[asyncio.Task[None]] = set()

    def begin(
        self, path: str, body: bytes, sent: float, max_tokens: int | None = None
    ) -> asyncio.Future[Exchange]:
        """Send now if a connection is idle (no task switch), else once one is open; the future
        resolves when the answer's body has ended, or fails with ``Failed`` (``timeout`` once
        ``timeout`` seconds have passed since this call, whatever the server is sending)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Exchange] = loop.create_future()
        # One timer for the whole request, no task: on the loop's clock, from now.
        deadline = loop.call_at(loop.time() + self._timeout, _expire, future)
        future.add_done_callback(lambda _: deadline.cancel())
        request = self.prepare(path, body)
        exchange = Exchange(sent, max_tokens)
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                connection.start(request, exchange, future)
                return future
        self._connect(request, exchange, future)
        return future

    def prepare(self, path: str, body: bytes) -> Request:
        """The POST of ``body`` to ``path`` (h11 checks its head once, here)."""
        head = h11.Request(
            method=b"POST",
            target=f"{self._prefix}{path}".encode("latin-1"),
            headers=[(b"content-length", b"%d" % len(body)), *self._fixed],
        )
        return head, body

    async def aclose(self) -> None:
        for task in list(self._connecting):
            task.cancel()
        for connection in list(self._open):
            connection._close()
        self._idle.clear()

    async def _connect_and_start(
        self, request: Request, exchange: Exchange, future: asyncio.Future[Exchange]
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Bounded by _connect's timer, which cancels this task (not asyncio.wait_for: before
            # Python 3.12 it can swallow a cancellation).
            _, connection = await loop.create_connection(
                lambda: _Connection(self), self._host, self._port, ssl=self._ssl
            )
        except OSError:
            if not future.done():
                future.set_exception(Failed("transport_ConnectError"))
            return
        self._open.add(connection)
        if future.done():  # cancelled while connecting
            connection._close()
            return
        connection.start(request, exchange, future)

    def _connect(self, request: Request, exchange: Exchange, future: asyncio.Future[Exchange]) -> None:
        loop = future.get_loop()
        task = loop.create_task(self._connect_and_start(request, exchange, future))
        self._connecting.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._connecting.discard)
        # The request's end (its deadline, or cancelled) ends its connecting too; no connection
        # within connect_timeout ends the request.
        future.add_done_callback(lambda _: task.cancel())
        slow = loop.call_at(loop.time() + self._connect_timeout, _expire, future)
        task.add_done_callback(lambda _: slow.cancel())

    def _release(self, connection: _Connection) -> None:
        self._idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
