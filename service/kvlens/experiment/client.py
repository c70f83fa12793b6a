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
answer's ``usage``: prompt tokens and ``prompt_tokens_details.cached_tokens``. A server that
leaves ``cached_tokens`` out (vLLM without ``--enable-prompt-tokens-details``) is said once; the
record then has no ``cached_tokens`` unless ``missing_cached_is_zero``. A request that fails (an
HTTP status, a timeout, a reset, a malformed stream) is recorded with ``error`` and no timings,
so it never enters a latency figure.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any, Final

import httpx
import numpy as np
import numpy.typing as npt
import orjson

from kvlens.definitions import quantiles
from kvlens.errors import InputError
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.simulate.trace import TraceRequest

log = logging.getLogger("kvlens.experiment")
# One line of an answer at most: vLLM's chunks are a few hundred bytes, its usage line smaller;
# a line past this (a server that never sends a newline) fails the request, not the memory.
MAX_LINE_BYTES: Final = 1024 * 1024
# A /detokenize answer at most (a 128k-token prompt as text is well under it).
MAX_DETOKENIZE_BYTES: Final = 16 * 1024 * 1024
# A usage count past this is no model's (records and their sums stay far from int64's end).
MAX_USAGE_TOKENS: Final = 2**31

WARMUP = "warmup"
MEASURE = "measure"
COMPLETIONS, CHAT = "completions", "chat"


@dataclass(frozen=True)
class Planned:
    """One request of the replay: the trace's request, when to send it (seconds from the start of
    the replay), how many tokens to generate, and its phase. Its token ids are drawn just before it
    is sent (a trace's prompts held at once would not fit in memory)."""

    request: TraceRequest
    due: float
    output_tokens: int
    phase: str = MEASURE

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
    url: str  # the server's base URL, without /v1
    model: str
    api_key: str | None = None
    timeout_seconds: float = 600.0
    max_concurrency: int = 256
    missing_cached_is_zero: bool = False
    late_after_seconds: float = 0.005  # a request sent this much after its time is counted late
    api: str = COMPLETIONS  # or CHAT: the prompt as text (from /detokenize) in one user message

    def __post_init__(self) -> None:
        if not self.timeout_seconds > 0:  # NaN too: asyncio takes no NaN deadline
            raise InputError(f"--timeout must be a positive number of seconds, not {self.timeout_seconds:g}")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == CHAT else "/v1/completions"


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


async def replay(
    planned: Iterable[Planned],
    prompts: PromptSynthesizer,
    endpoint: Endpoint,
    arm: str,
    writer: RecordWriter,
    progress: Progress | None = None,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Progress:
    """Send every planned request at its time (open loop) and write its record as it ends."""
    progress = progress or Progress()
    slots = asyncio.Semaphore(endpoint.max_concurrency)
    limits = httpx.Limits(
        max_connections=endpoint.max_concurrency, max_keepalive_connections=endpoint.max_concurrency
    )
    headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    timeout = httpx.Timeout(endpoint.timeout_seconds, connect=min(10.0, endpoint.timeout_seconds))
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(
        base_url=endpoint.url, limits=limits, headers=headers, timeout=timeout, transport=transport
    ) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        wall_start = time.time()
        for request in planned:
            tokens = prompts.tokens(request.request)  # built while waiting for the request's time
            body = (
                await _chat_body(client, endpoint.model, tokens, request.output_tokens)
                if endpoint.api == CHAT
                else _body(endpoint.model, tokens, request.output_tokens)
            )
            delay = start + request.due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            sent = loop.time()
            lag = max(0.0, sent - start - request.due)
            progress.sent += 1
            progress.in_flight += 1
            progress.lags.append(lag)
            if lag > endpoint.late_after_seconds:
                progress.late += 1
            timing = _Timing(sent, lag, wall_start + (sent - start))
            task = asyncio.create_task(_one(client, endpoint, arm, request, body, timing, writer, progress))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(lambda _: slots.release())
        if tasks:
            await asyncio.gather(*tasks)
    return progress


@dataclass(frozen=True)
class _Timing:
    sent: float  # the loop's clock
    lag: float
    wall: float  # unix seconds, for the record's arrival_time


def _generation(output_tokens: int) -> dict[str, Any]:
    return {
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,  # the trace's length, whatever the model would say
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _body(model: str, prompt: npt.NDArray[np.uint64], output_tokens: int) -> bytes:
    """The request as vLLM's ``/v1/completions`` takes it: token ids, exact lengths."""
    return orjson.dumps(
        {"model": model, "prompt": prompt, **_generation(output_tokens)}, option=orjson.OPT_SERIALIZE_NUMPY
    )


async def _chat_body(
    client: httpx.AsyncClient, model: str, prompt: npt.NDArray[np.uint64], output_tokens: int
) -> bytes:
    """The request for ``/v1/chat/completions``: the ids turned into text by the server's own
    ``/detokenize``, in one user message. The server tokenizes that text again and adds its chat
    template, so prompt lengths are approximate (the records carry the server's count); a
    detokenize that fails leaves the request to fail as a request."""
    content = orjson.dumps({"model": model, "tokens": prompt}, option=orjson.OPT_SERIALIZE_NUMPY)
    try:
        raw = await asyncio.wait_for(_detokenize(client, content), client.timeout.read)
        text = orjson.loads(raw)["prompt"] if raw is not None else ""
    except (httpx.HTTPError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
        text = ""
    messages = [{"role": "user", "content": text if isinstance(text, str) else ""}]
    return orjson.dumps({"model": model, "messages": messages, **_generation(output_tokens)})


async def _detokenize(client: httpx.AsyncClient, content: bytes) -> bytes | None:
    """The answer's body, or None: not a 200, compressed, or past MAX_DETOKENIZE_BYTES."""
    async with client.stream("POST", "/detokenize", content=content, headers=_HEADERS) as answer:
        if answer.status_code != 200 or not _identity(answer):
            return None
        body = bytearray()
        async for piece in answer.aiter_raw():
            body += piece
            if len(body) > MAX_DETOKENIZE_BYTES:
                return None
        return bytes(body)


async def _one(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    arm: str,
    request: Planned,
    body: bytes,
    timing: _Timing,
    writer: RecordWriter,
    progress: Progress,
) -> None:
    record: dict[str, Any] = {
        "request_id": f"trace-{request.index}",  # the same in every arm: compare pairs them
        "model": endpoint.model,
        "prompt_tokens": request.request.prompt_tokens,
        "arrival_time": round(timing.wall, 6),
        "arm": arm,
        "phase": request.phase,
        "trace_index": request.index,
        "client_scheduled_seconds": request.due,
        "client_send_lag_seconds": timing.lag,
    }
    try:
        try:
            # the whole request, not each read: a server that trickles forever is a timeout too
            stream = await asyncio.wait_for(
                _stream(client, endpoint.path, body, timing.sent, request.output_tokens),
                endpoint.timeout_seconds,
            )
        except asyncio.TimeoutError:
            raise _Failed("timeout") from None
        if stream.usage is not None and not _plausible(stream.usage, request.request.prompt_tokens):
            raise _Failed("invalid_usage")
    except _Failed as failure:
        record["error"] = failure.reason
        progress.errors += 1
    else:
        _fill(record, stream, endpoint, progress)
    finally:
        progress.in_flight -= 1
    progress.done += 1
    writer.write(record)


class _Failed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Stream:
    token_times: list[float] = field(default_factory=list)  # loop-clock seconds after the send
    usage: dict[str, Any] | None = None
    end: float = math.nan


_HEADERS: Final = {"content-type": "application/json", "accept-encoding": "identity"}


async def _stream(
    client: httpx.AsyncClient, path: str, body: bytes, sent: float, output_tokens: int
) -> _Stream:
    """The answer's stream, read line by line; :class:`_Failed` says why it is not one. It holds
    at most a line (MAX_LINE_BYTES) and ``output_tokens`` token times: a stream that sends more
    tokens than were asked is refused, not followed forever."""
    loop = asyncio.get_running_loop()
    result = _Stream()
    try:
        async with client.stream("POST", path, content=body, headers=_HEADERS) as response:
            if response.status_code != 200:
                raise _Failed(f"http_{response.status_code}")  # its body is not read: it may not end
            if not _identity(response):
                raise _Failed("content_encoding")  # asked for none: a bomb is not inflated
            done = False
            async for line in _lines(response):
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    raise _Failed("malformed_stream") from None
                if not isinstance(chunk, dict):
                    raise _Failed("malformed_stream")
                if "error" in chunk:
                    raise _Failed("stream_error")
                if any(_carries_text(choice) for choice in chunk.get("choices") or ()):
                    if len(result.token_times) == output_tokens:
                        raise _Failed("too_many_tokens")
                    result.token_times.append(loop.time() - sent)
                if isinstance(chunk.get("usage"), dict):
                    result.usage = chunk["usage"]
            if not done:
                raise _Failed("stream_ended_early")
    except httpx.TimeoutException:
        raise _Failed("timeout") from None
    except httpx.TransportError as error:
        raise _Failed(f"transport_{type(error).__name__}") from None
    result.end = loop.time() - sent
    if not result.token_times:
        raise _Failed("no_tokens")
    return result


def _identity(response: httpx.Response) -> bool:
    return response.headers.get("content-encoding", "identity").strip().lower() in ("identity", "")


async def _lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """The answer's lines (``\n``-ended, a ``\r`` before it dropped), each at most MAX_LINE_BYTES."""
    pending = b""
    async for piece in response.aiter_raw():
        lines = (pending + piece).split(b"\n")
        pending = lines.pop()
        if len(pending) > MAX_LINE_BYTES or any(len(line) > MAX_LINE_BYTES for line in lines):
            raise _Failed("line_too_long")
        for line in lines:
            yield line.removesuffix(b"\r")
    if pending:
        yield pending


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < MAX_USAGE_TOKENS


def _plausible(usage: dict[str, Any], sent_prompt_tokens: int) -> bool:
    """Counts a record can carry: whole numbers (not true/false) from 0 up, cached tokens no more
    than the prompt's (the server's count, else the one sent). A field left out is left out of the
    record; one that cannot be is an error."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if any(value is not None and not _count(value) for value in (prompt, completion, cached)):
        return False
    return cached is None or cached <= (sent_prompt_tokens if prompt is None else prompt)


def _carries_text(choice: Any) -> bool:
    """A completion chunk's ``text``, or a chat chunk's ``delta.content``, is not empty."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(choice.get("text") or (isinstance(delta, dict) and delta.get("content")))


def _fill(record: dict[str, Any], stream: _Stream, endpoint: Endpoint, progress: Progress) -> None:
    ttft = stream.token_times[0]
    record["ttft_seconds"] = ttft
    record["e2e_seconds"] = stream.end
    record["decode_seconds"] = stream.end - ttft
    times = stream.token_times
    # Plain Python: a few dozen gaps; numpy's percentile costs ~100 us a call on the client's loop.
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(times))
    record["output_tokens"] = len(stream.token_times)
    if gaps:
        p50, p99 = quantiles(len(gaps), (0.5, 0.99), lambda ranks: [gaps[rank] for rank in ranks])
        record["client_itl_p50_seconds"] = p50
        record["client_itl_p99_seconds"] = p99
        record["client_tpot_seconds"] = (times[-1] - times[0]) / len(gaps)  # vLLM's time per output token
    usage = stream.usage or {}
    if isinstance(usage.get("prompt_tokens"), int):
        record["prompt_tokens"] = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        record["output_tokens"] = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        record["cached_tokens"] = cached
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
