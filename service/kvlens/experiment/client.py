"""An open-loop client that replays planned requests against an OpenAI-compatible endpoint and
writes one kvlens record per request as it ends.

Open loop: each request is sent at its planned time whatever the endpoint is doing, so a slow
server builds a queue (as production traffic would) instead of slowing the arrivals. At most
``max_concurrency`` requests are in flight; a request that cannot start on time (no free slot, or
the client itself behind) starts as soon as it can and is recorded as **late** with its lag, never
silently shifted.

Measured per request, on the client's monotonic clock: the send time and its lag behind
schedule, TTFT (the first chunk carrying text), the gaps between later chunks (inter-token
latency: p50, p99 and their mean, vLLM's time per output token), end to end, and from the
answer's ``usage`` (read by :mod:`kvlens.sources.usage`, either API's names): prompt, cached and
output tokens. A server that leaves ``cached_tokens`` out (vLLM without
``--enable-prompt-tokens-details``) is said once; the record then has no ``cached_tokens`` unless
``missing_cached_is_zero``. A request that fails (an
HTTP status, a timeout, a reset, a malformed stream) is recorded with ``error`` and no timings,
so it never enters a latency figure.

A hostile endpoint cannot hold the run or its memory: ``timeout`` bounds each whole request
(a stream that trickles forever is a ``timeout``), a line past MAX_LINE_BYTES is
``line_too_long``, more chunks with text than the request's ``max_tokens`` is
``too_many_tokens``, a compressed answer is ``content_encoding`` (never inflated), usage counts
that cannot be are ``invalid_usage``, a chunk of a shape not expected is ``malformed_stream``,
and an error status is ``http_STATUS`` with the server's reason in ``error_message`` (read from
a bounded part of its body, within a second, printable, at most 200 characters). The runner's
other calls (checks, resets, samples, ``/detokenize``) are bounded by ``calls``.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
import numpy as np
import numpy.typing as npt
import orjson

from kvlens.errors import InputError, ScrapeError
from kvlens.experiment import calls
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.stream import MAX_LINE_BYTES as MAX_LINE_BYTES  # the replay's limits, all here
from kvlens.experiment.stream import Exchange, Failed, StreamClient
from kvlens.simulate.trace import TraceRequest
from kvlens.sources.usage import Usage, read_usage
from kvlens.stats import itl_percentiles

log = logging.getLogger("kvlens.experiment")

WARMUP = "warmup"
MEASURE = "measure"
COMPLETIONS, CHAT = "completions", "chat"


@dataclass(frozen=True)
class Planned:
    """One request of the replay: the trace's request, when to send it (seconds from the start of
    the replay), how many tokens to generate, and its phase. Its token ids are drawn shortly before it
    is sent, a bounded number ahead (a trace's prompts held at once would not fit in memory)."""

    request: TraceRequest
    due: float
    output_tokens: int
    phase: str = MEASURE
    reusable_tokens: int | None = None  # what an unbounded cache would serve it in this run's order
    salt: str | None = None  # its cache_salt (its conversation's, with --salt-per-session)

    @property
    def index(self) -> int:
        return self.request.index


@dataclass
class Progress:
    """What the replay has done so far (read by a progress bar; written by one event loop)."""

    sent: int = 0
    done: int = 0
    in_flight: int = 0
    late: int = 0
    errors: int = 0
    missing_cached: int = 0
    lags: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def rate(self, now: float | None = None) -> float:
        """Requests finished per second since the replay began."""
        elapsed = (time.monotonic() if now is None else now) - self.started
        return self.done / elapsed if elapsed > 0 else 0.0


@dataclass(frozen=True)
class Endpoint:
    """An endpoint and how to call it. ``url`` is the server's base URL (without /v1) as it may
    be shown: credentials in it (``http://user:password@host``) are taken out into ``basic_auth``
    when the endpoint is made, so no message, log line or report ever holds them; they go, as the
    ``api_key`` does, in the ``authorization`` header of every call and every stream."""

    url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    timeout_seconds: float = 600.0
    max_concurrency: int = 256
    missing_cached_is_zero: bool = False
    late_after_seconds: float = 0.005  # a request sent this much after its time is counted late
    api: str = COMPLETIONS  # or CHAT: the prompt as text (from /detokenize) in one user message
    basic_auth: tuple[str, str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.timeout_seconds > 0:  # NaN too: asyncio takes no NaN deadline
            raise InputError(f"--timeout must be a positive number of seconds, not {self.timeout_seconds:g}")
        url, basic_auth = base_url(self.url)
        if basic_auth is not None:
            if self.api_key is not None or self.basic_auth is not None:
                raise InputError(f"{url}: credentials in the URL and an API key: give one of them")
            object.__setattr__(self, "basic_auth", basic_auth)
        object.__setattr__(self, "url", url)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == CHAT else "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        """The ``authorization`` of every call to the endpoint (none without credentials)."""
        if self.api_key is not None:
            return {"authorization": f"Bearer {self.api_key}"}
        if self.basic_auth is not None:
            user_password = ":".join(self.basic_auth).encode("utf-8")
            return {"authorization": f"Basic {base64.b64encode(user_password).decode('ascii')}"}
        return {}


def without_userinfo(url: str) -> str:
    """``url`` as it may be shown: without ``user:password@`` (nor a query or fragment, which may
    hold a secret too); a text that is not a URL shows as ``the URL given``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "the URL given"
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def base_url(url: str) -> tuple[str, tuple[str, str] | None]:
    """An endpoint's URL without its userinfo, and the credentials the userinfo held; raises
    InputError (naming the URL without them) when it is not an http(s) URL of a host."""
    shown = without_userinfo(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port out of range raises here)
    except ValueError:
        raise InputError(f"{shown} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"{shown} is not an http:// or https:// URL of a host")
    if parts.query or parts.fragment:
        raise InputError(f"{shown}: an endpoint's URL takes no query or fragment")
    if parts.username is None and "@" not in parts.netloc:
        return url, None
    credentials = (unquote(parts.username or ""), unquote(parts.password or ""))
    return shown, credentials


class RecordWriter:
    """Appends each record as one JSON line and flushes it, so that an interrupted run keeps every
    finished request, each line whole."""

    def __init__(self, out: IO[bytes], push: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._out = out
        self._push = push
        self.written = 0

    def write(self, record: dict[str, Any]) -> None:
        self._out.write(orjson.dumps(record) + b"\n")
        self._out.flush()
        self.written += 1
        if self._push is not None:
            self._push(record)


LOOKAHEAD_REQUESTS = 64  # bodies prepared ahead of their send time, at most
LOOKAHEAD_BYTES = 32 * 1024 * 1024  # and at most this many bytes of them
_PREPARE_SLACK = 0.002  # another body is prepared ahead only with this much time before a send
_COARSE = 0.001  # the event loop wakes within ~1 ms of a timer (epoll's resolution): spin the rest


async def replay(
    planned: Iterable[Planned],
    prompts: PromptSynthesizer,
    endpoint: Endpoint,
    arm: str,
    writer: RecordWriter,
    progress: Progress | None = None,
) -> Progress:
    """Send every planned request at its time (open loop) and write its record as it ends.

    The loop does as little as it can at a send: bodies (token ids drawn, orjson-encoded) are
    prepared ahead of their time while there is slack, the wait ends with a short spin past the
    loop's timer resolution, and the request is written on an idle connection in the same step
    (``stream.StreamClient``); its record is written from the answer's completion callback."""
    progress = progress or Progress()
    slots = asyncio.Semaphore(endpoint.max_concurrency)
    client = StreamClient(
        endpoint.url,
        endpoint.headers,
        timeout=endpoint.timeout_seconds,
        connect_timeout=min(10.0, endpoint.timeout_seconds),
    )
    detokenizer = calls.client() if endpoint.api == CHAT else None
    pending: set[asyncio.Future[Exchange]] = set()
    ready: collections.deque[tuple[Planned, bytes]] = collections.deque()
    requests = iter(planned)
    ready_bytes = 0

    async def prepare() -> bool:
        nonlocal ready_bytes
        request = next(requests, None)
        if request is None:
            return False
        tokens = prompts.tokens(request.request)
        body = (
            await chat_body(detokenizer, endpoint, tokens, request.output_tokens, request.salt)
            if detokenizer is not None
            else completions_body(endpoint.model, tokens, request.output_tokens, request.salt)
        )
        ready.append((request, body))
        ready_bytes += len(body)
        return True

    try:
        start = time.perf_counter()
        wall_start = time.time()
        while ready or await prepare():
            request, body = ready.popleft()
            ready_bytes -= len(body)
            due = start + request.due
            while (
                len(ready) < LOOKAHEAD_REQUESTS
                and ready_bytes < LOOKAHEAD_BYTES
                and due - time.perf_counter() > _PREPARE_SLACK
                and await prepare()
            ):
                pass
            await sleep_until(due)
            await slots.acquire()
            answer = send_planned(
                client, endpoint, arm, request, body, (start, due, wall_start), writer, progress, pending
            )
            answer.add_done_callback(lambda _: slots.release())
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for answer in list(pending):  # interrupted: what was in flight is not measured, not an error
            answer.cancel()
        await client.aclose()
        if detokenizer is not None:
            await detokenizer.aclose()
    return progress


async def sleep_until(deadline: float) -> None:
    """Sleep on the loop's timer to within ``_COARSE`` of the deadline, then yield to the loop
    (which keeps serving the streams) until it passes: a timer alone wakes up to ~1 ms late."""
    delay = deadline - time.perf_counter()
    if delay > _COARSE:
        await asyncio.sleep(delay - _COARSE)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)


def _generation(output_tokens: int) -> dict[str, Any]:
    return {
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,  # the trace's length, whatever the model would say
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _salted(salt: str | None) -> dict[str, Any]:
    """vLLM's ``cache_salt``: blocks are shared only between requests of one salt."""
    return {} if salt is None else {"cache_salt": salt}


def completions_body(
    model: str,
    prompt: npt.NDArray[np.uint64] | list[int],
    output_tokens: int,
    salt: str | None = None,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """The request as vLLM's ``/v1/completions`` takes it: token ids, exact lengths; ``extra``
    fields beside them (the isolation audit's salt, under the field name it was given)."""
    return orjson.dumps(
        {"model": model, "prompt": prompt, **_generation(output_tokens), **_salted(salt), **(extra or {})},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


async def chat_body(
    pool: httpx.AsyncClient,
    endpoint: Endpoint,
    prompt: npt.NDArray[np.uint64],
    output_tokens: int,
    salt: str | None = None,
) -> bytes:
    """The request for ``/v1/chat/completions``: the ids turned into text by the server's own
    ``/detokenize``, in one user message. The server tokenizes that text again and adds its chat
    template, so prompt lengths are approximate (the records carry the server's count); a
    detokenize that fails (not a 200, past ``--timeout`` in all, past MAX_CALL_BYTES once
    inflated, not its JSON) leaves the request to fail as a request."""
    content = orjson.dumps({"model": endpoint.model, "tokens": prompt}, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = {**endpoint.headers, "content-type": "application/json"}
    try:
        answer = await calls.call(
            pool,
            endpoint.url,
            "POST",
            "/detokenize",
            headers=headers,
            seconds=endpoint.timeout_seconds,
            content=content,
        )
        text = orjson.loads(answer.body)["prompt"] if answer.status == 200 else ""
    except (ScrapeError, ValueError, KeyError, TypeError):
        text = ""
    messages = [{"role": "user", "content": text if isinstance(text, str) else ""}]
    return orjson.dumps(
        {"model": endpoint.model, "messages": messages, **_generation(output_tokens), **_salted(salt)}
    )


def send_planned(
    client: StreamClient,
    endpoint: Endpoint,
    arm: str,
    request: Planned,
    body: bytes,
    clock: tuple[float, float, float],
    writer: RecordWriter,
    progress: Progress,
    pending: set[asyncio.Future[Exchange]],
) -> asyncio.Future[Exchange]:
    """Send ``request`` now (its slot taken) and begin its record, ended by its answer: the one
    step of both schedules (timestamps here, sessions in :mod:`kvlens.experiment.sessions`).
    ``clock``: the run's start (perf counter), the request's due time on it, and the run's start
    in wall time; its lag behind ``due`` is counted, late past the endpoint's bound."""
    start, due, wall_start = clock
    sent = time.perf_counter()
    lag = max(0.0, sent - due)
    progress.sent += 1
    progress.in_flight += 1
    progress.lags.append(lag)
    if lag > endpoint.late_after_seconds:
        progress.late += 1
    record = request_record(endpoint, arm, request, lag, wall_start + (sent - start))
    answer = client.begin(endpoint.path, body, sent, request.output_tokens)
    pending.add(answer)
    answer.add_done_callback(
        functools.partial(ended_record, record=record, endpoint=endpoint, writer=writer, progress=progress)
    )
    answer.add_done_callback(pending.discard)
    return answer


def request_record(endpoint: Endpoint, arm: str, request: Planned, lag: float, wall: float) -> dict[str, Any]:
    record = {
        "request_id": f"trace-{request.index}",  # the same in every arm: compare pairs them
        "model": endpoint.model,
        "prompt_tokens": request.request.prompt_tokens,
        "arrival_time": round(wall, 6),
        "arm": arm,
        "phase": request.phase,
        "trace_index": request.index,
        "client_scheduled_seconds": request.due,
        "client_send_lag_seconds": lag,
    }
    if request.request.session is not None:
        record["session_id"] = request.request.session  # a record field, never a label
    if request.reusable_tokens is not None:
        record["trace_reusable_tokens"] = request.reusable_tokens
    return record


def ended_record(
    answer: asyncio.Future[Exchange],
    *,
    record: dict[str, Any],
    endpoint: Endpoint,
    writer: RecordWriter,
    progress: Progress,
) -> None:
    progress.in_flight -= 1
    if answer.cancelled():
        return  # the run was interrupted: nothing was measured
    failure = answer.exception()
    usage = read_usage(answer.result().usage or {}) if failure is None else Usage()
    if failure is None and usage.invalid(record["prompt_tokens"]) is not None:
        failure = Failed("invalid_usage")
    if failure is not None:
        # Failed carries the reason; anything else is the client's own fault, recorded all the same.
        reason = failure.reason if isinstance(failure, Failed) else f"client_{type(failure).__name__}"
        record["error"] = reason
        if isinstance(failure, Failed) and failure.message:
            record["error_message"] = failure.message  # the server's reason, bounded and printable
        progress.errors += 1
    else:
        _fill(record, answer.result(), usage, endpoint, progress)
    progress.done += 1
    writer.write(record)


def _fill(
    record: dict[str, Any], stream: Exchange, usage: Usage, endpoint: Endpoint, progress: Progress
) -> None:
    """The timings, and the counts the usage reports (checked: :meth:`Usage.invalid`) over the
    prompt sent and the chunks seen."""
    times = [arrival - stream.sent for arrival in stream.token_times]
    ttft, end = times[0], stream.end - stream.sent
    record["ttft_seconds"] = ttft
    record["e2e_seconds"] = end
    record["decode_seconds"] = end - ttft
    record["output_tokens"] = len(stream.token_times)
    record.update(itl_percentiles(later - earlier for earlier, later in itertools.pairwise(times)))
    if len(times) > 1:  # vLLM's time per output token: the mean gap
        record["client_tpot_seconds"] = (times[-1] - times[0]) / (len(times) - 1)
    record.update(usage.counts())
    if usage.cached_tokens is not None:
        return
    if progress.missing_cached == 0:
        log.warning(
            "the endpoint reports no usage.prompt_tokens_details.cached_tokens (vLLM: start it with "
            "--enable-prompt-tokens-details); records carry %s",
            "cached_tokens 0" if endpoint.missing_cached_is_zero else "no cached_tokens",
        )
    progress.missing_cached += 1
    if endpoint.missing_cached_is_zero:
        record["cached_tokens"] = 0
