"""Request traces for the simulator and the replay: Mooncake, Alibaba Bailian (Qwen), kvlens
records, and the agentic traces: kv-cache-tester conversations (``conversations``), Dynamo's
agentic Mooncake rows and BurstGPT (``trace_rows``), whose requests keep their session, turn,
parent and think time (``trace_request``). The format is told by the content (a directory is
conversations) unless ``trace_format`` names it.

Each line becomes a :class:`TraceRequest`: arrival in seconds from the trace's start, prompt and
output tokens, and the keys of the prompt's **full** blocks (a partial last block is never cached,
DESIGN section 1). A key stands for the block and its whole prefix:

- Mooncake (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``; 512-token
  blocks): its ids are already chained (an id appears at one position only, always after the
  same id), so they are the keys.
- Bailian (``chat_id``, ``parent_chat_id`` -1 for a first turn, ``timestamp`` in seconds,
  ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids``; 16-token blocks): its ids
  hash each block alone (salted SipHash of the block's tokens, remapped to integers), so kvlens
  chains them: key ``i`` is the hash of (key ``i-1``, id ``i``).
- kvlens records with ``prefix_hashes`` (chained by the engine, as vLLM's are) and
  ``block_size``; ``arrival_time`` orders them.

A Mooncake or Bailian line may carry ``cache_salt`` (a string, vLLM's request field): its keys
are then :func:`salted` as vLLM salts them, in ``kvlens simulate`` as in ``simulate serve``.

A trace's lines must arrive in time order (Mooncake and Bailian files do); kvlens records are
read whole and sorted, since they are written as requests finish. A line that is not a request
of the trace's format raises :class:`TraceError` naming the file, the line and the field; so do

- a line longer than ``jsonlines.MAX_LINE_BYTES`` (64 MiB), refused as soon as it passes the
  limit, never held (a file with no newline, a link to /dev/zero, a small gzip of one endless
  line);
- a request of more than ``records.MAX_TOKENS`` (10M) prompt or output tokens: the longest
  context served models offer is about that, and a replay builds each prompt in memory (tens of
  bytes a token) before it sends it; the replay also refuses what its endpoint's
  ``max_model_len`` cannot take (``experiment/protocol.check_context``);
- a gap over :data:`MAX_GAP_SECONDS` (a day) between consecutive requests (in arrival order,
  before any time scale): a replay would wait that long, silently, for the next request; such a
  gap is a timestamp in the wrong unit or out of place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import orjson

from kvlens.simulate import conversations
from kvlens.simulate.trace_request import Scope as Scope
from kvlens.simulate.trace_request import TraceError as TraceError
from kvlens.simulate.trace_request import TraceRequest as TraceRequest
from kvlens.simulate.trace_request import chain as chain
from kvlens.simulate.trace_request import count, full_ids, integers, seconds, stable_key
from kvlens.simulate.trace_request import salted as salted
from kvlens.simulate.trace_rows import AgenticRows, BurstRows, is_burstgpt
from kvlens.sources import jsonlines

MOONCAKE: Final = "mooncake"
BAILIAN: Final = "bailian"
KVLENS: Final = "kvlens"
CONVERSATIONS: Final = "kv-cache-tester"
AGENTIC: Final = "agentic-mooncake"
BURSTGPT: Final = "burstgpt"
FORMATS: Final = (MOONCAKE, BAILIAN, KVLENS, CONVERSATIONS, AGENTIC, BURSTGPT)
BLOCK_SIZES: Final = {MOONCAKE: 512, BAILIAN: 16}  # kvlens records and conversations carry theirs
# Formats that do not say their block size: this one unless --block-size says otherwise (agentic
# rows' hashes are Mooncake's, at 512 unless made otherwise; BurstGPT has no hashes at all).
DEFAULT_BLOCK_SIZES: Final = {AGENTIC: 512, BURSTGPT: 16}
MAX_GAP_SECONDS: Final = 86_400.0
_CHUNK_BYTES: Final = 1024 * 1024  # read at a time (a trace line is a few KiB)
# The Mooncake synthetic trace (kvcache-ai/Mooncake, Apache-2.0; data/NOTICE), bundled for
# `kvlens demo` and for `kvlens simulate` without a trace.
BUNDLED: Final = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"
# Eight kv-cache-tester conversations (callanjfox/kv-cache-tester, Apache-2.0; data/agentic/NOTICE),
# bundled for `kvlens demo --traffic agentic`.
BUNDLED_AGENTIC: Final = BUNDLED.parent / "agentic"


@dataclass(frozen=True)
class Trace:
    path: str
    format: str
    block_size: int
    time_scale: float = 1.0
    session_rate: float | None = None  # conversations: one starts every 1/session_rate s

    def requests(self) -> Iterator[TraceRequest]:
        """The requests in arrival order, read as they are needed (kvlens records and
        conversations: all at once)."""
        numbered = self._numbered()
        if self.format == KVLENS:
            numbered = iter(sorted(numbered, key=lambda item: (item[1].arrival, item[1].index)))
        last = None
        for number, request in numbered:
            if last is not None and request.arrival - last > MAX_GAP_SECONDS:
                field = {KVLENS: "arrival_time", CONVERSATIONS: "t"}.get(self.format, "timestamp")
                where = "request" if self.format == CONVERSATIONS else "line"
                raise TraceError(
                    f"{self.path} {where} {number}: {field} is {_text(request.arrival - last)} s after the "
                    f"request before it; a gap over {MAX_GAP_SECONDS:,.0f} s (a day) is refused: a replay "
                    "would wait that long for its next request (a timestamp in the wrong unit, or out of "
                    "place?)"
                )
            last = request.arrival
            yield request if self.time_scale == 1.0 else _scaled(request, self.time_scale)

    def _numbered(self) -> Iterator[tuple[int, TraceRequest]]:
        """Each request and its line, in the file's order."""
        if self.format == CONVERSATIONS:
            yield from conversations.numbered(self.path, self.block_size, self.session_rate)
            return
        if self.format == BURSTGPT:
            yield from self._csv()
            return
        parsers: dict[str, Callable[[dict[str, Any], int, int], TraceRequest]] = {
            MOONCAKE: _mooncake,
            BAILIAN: _bailian,
            KVLENS: _kvlens,
            AGENTIC: AgenticRows(),  # one per pass: it keeps the rows' ids
        }
        parse = parsers[self.format]
        last = 0.0
        index = 0
        for number, line in _lines(self.path):
            if not line.strip():
                continue
            try:
                value = orjson.loads(line)
                if not isinstance(value, dict):
                    raise ValueError("not a JSON object")
                request = parse(value, index, self.block_size)
            except (orjson.JSONDecodeError, ValueError, TypeError) as error:
                raise TraceError(f"{self.path} line {number}: {error}") from None
            last = _in_order(self.path, number, request, last, self.format != KVLENS)
            yield number, request
            index += 1

    def _csv(self) -> Iterator[tuple[int, TraceRequest]]:
        parse = BurstRows()
        last = 0.0
        index = 0
        for number, line in _lines(self.path):
            if not line.strip():
                continue
            try:
                request = parse(line, index, self.block_size)
            except (ValueError, TypeError) as error:
                raise TraceError(f"{self.path} line {number}: {error}") from None
            if request is None:
                continue
            last = _in_order(self.path, number, request, last, True)
            yield number, request
            index += 1


def _in_order(path: str, number: int, request: TraceRequest, last: float, ordered: bool) -> float:
    if ordered and request.arrival < last:
        raise TraceError(
            f"{path} line {number}: timestamp goes back in time "
            f"({request.arrival:g} s after {last:g} s); sort the trace by timestamp"
        )
    return request.arrival


def open_trace(
    path: str | Path,
    *,
    block_size: int | None = None,
    time_scale: float = 1.0,
    rate: float | None = None,
    trace_format: str | None = None,
    session_rate: float | None = None,
) -> Trace:
    """The trace at ``path`` (a file, or a directory of conversation files), its format told by
    its content unless ``trace_format`` names it. Its block size is the format's (Mooncake 512,
    Bailian 16), the records' or the conversations' ``block_size``; a different ``block_size``
    is refused, since the trace's hashes were made at its own (agentic rows and BurstGPT do not
    say theirs: ``block_size`` is taken). ``time_scale`` multiplies arrival times (0.5: the same
    requests twice as fast); ``rate`` (requests per second) sets the scale so that the whole
    trace arrives at that mean rate (one extra pass over the file); ``session_rate`` starts one
    conversation every ``1 / session_rate`` seconds (conversation files)."""
    name = str(path)
    if trace_format is not None and trace_format not in FORMATS:
        raise TraceError(f"--trace-format {trace_format!r}: one of {', '.join(FORMATS)}")
    if name == "-":
        raise TraceError("-: a trace is read more than once: name a file, not standard input")
    directory = Path(name).is_dir()
    first = b"" if directory else _first_line(name)
    if trace_format == CONVERSATIONS or (
        trace_format is None and (directory or conversations.is_conversation(first, name))
    ):
        kind = CONVERSATIONS
        found = conversations.block_size(name)
    else:
        kind = trace_format or _detect(first, name)
        found = (
            BLOCK_SIZES.get(kind)
            or (block_size or DEFAULT_BLOCK_SIZES[kind] if kind in DEFAULT_BLOCK_SIZES else 0)
            or _records_block_size(first, block_size, name)
        )
    if block_size is not None and block_size != found:
        raise TraceError(
            f"{name}: the trace's blocks are {found} tokens, not --block-size {block_size}: its hashes "
            "were made at its own block size and cannot be re-cut"
        )
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise TraceError("time scale must be a positive number")
    if session_rate is not None and kind != CONVERSATIONS:
        raise TraceError(
            f"--session-rate starts conversation files ({CONVERSATIONS}); {name} is {kind}: "
            "its sessions start at their recorded times"
        )
    trace = Trace(name, kind, found, time_scale, session_rate)
    if rate is not None:
        if not (math.isfinite(rate) and rate > 0):
            raise TraceError("rate must be a positive number of requests per second")
        requests, span = 0, 0.0
        for request in trace.requests():
            requests, span = requests + 1, request.arrival
        if requests < 2 or span <= 0:
            raise TraceError(f"{name}: a rate needs two or more requests spread over time")
        trace = replace(trace, time_scale=time_scale * (requests - 1) / (span * rate))
    return trace


def _first_line(path: str) -> bytes:
    for _, line in _lines(path):
        if line.strip():
            return line
    raise TraceError(f"{path}: the trace is empty")


def _detect(line: bytes, path: str) -> str:
    if is_burstgpt(line):
        return BURSTGPT
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as error:
        raise TraceError(f"{path} line 1: not JSON ({error})") from None
    if isinstance(value, dict):
        if "hash_ids" in value and "chat_id" in value:
            return BAILIAN
        if "hash_ids" in value and "request_id" in value:
            return AGENTIC
        if "hash_ids" in value:
            return MOONCAKE
        if "prefix_hashes" in value and "prompt_tokens" in value:
            return KVLENS
    raise TraceError(
        f"{path} line 1: not a trace kvlens reads: a Mooncake line (timestamp, input_length, "
        "output_length, hash_ids), an agentic Mooncake row (... request_id, session_id), a Bailian "
        "one (chat_id, parent_chat_id, ... hash_ids), a kvlens record with prefix_hashes, BurstGPT's "
        "CSV header (Timestamp, ..., Request tokens, Response tokens) or a kv-cache-tester "
        "conversation (a JSON object with block_size and requests[]; or a directory of them)"
    )


def _records_block_size(first: bytes, block_size: int | None, path: str) -> int:
    found = orjson.loads(first).get("block_size")
    if isinstance(found, int) and found >= 1:
        return found
    if block_size is not None:
        return block_size
    raise TraceError(f"{path} line 1: records without block_size need --block-size")


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(number, line) of the file (gzip or not) through the bounded reader: a line past
    MAX_LINE_BYTES, or a gzip stream that breaks, is a TraceError when it is met. A trace is read
    more than once (its format, a rate's pass, the requests), so never standard input."""
    if path == "-":
        raise TraceError("-: a trace is read more than once: name a file, not standard input")

    def too_long(number: int) -> None:
        raise TraceError(f"{path} line {number}: longer than {jsonlines.MAX_LINE_BYTES:,} bytes: not read")

    def broken(message: str) -> None:
        raise TraceError(message)

    try:
        with jsonlines.open_file(path) as stream:
            for first, chunk in jsonlines.line_chunks(stream, _CHUNK_BYTES, None, path, broken, too_long):
                for offset, line in enumerate(chunk.split(b"\n")):
                    yield first + offset, line
    except OSError as error:
        raise TraceError(f"{path}: cannot read: {error}") from None


def _mooncake(line: dict[str, Any], index: int, block_size: int) -> TraceRequest:
    prompt = count(line.get("input_length"), "input_length", 1)
    ids = full_ids(line.get("hash_ids"), prompt, block_size, "hash_ids")
    return TraceRequest(
        index=index,
        arrival=seconds(line.get("timestamp"), "timestamp") / 1000.0,
        prompt_tokens=prompt,
        output_tokens=count(line.get("output_length"), "output_length"),
        blocks=integers(ids, "hash_ids"),
        cache_salt=_salt(line),
    )


def _bailian(line: dict[str, Any], index: int, block_size: int) -> TraceRequest:
    prompt = count(line.get("input_length"), "input_length", 1)
    ids = integers(full_ids(line.get("hash_ids"), prompt, block_size, "hash_ids"), "hash_ids")
    chat, parent = line.get("chat_id"), line.get("parent_chat_id")
    if type(chat) is not int or type(parent) is not int or parent < -1:
        raise ValueError("chat_id and parent_chat_id must be integers (parent_chat_id -1 for a first turn)")
    return TraceRequest(
        index=index,
        arrival=seconds(line.get("timestamp"), "timestamp"),
        prompt_tokens=prompt,
        output_tokens=count(line.get("output_length"), "output_length"),
        blocks=chain(ids),  # a later turn shares its chat's blocks through them, not through the ids
        cache_salt=_salt(line),
    )


def _kvlens(line: dict[str, Any], index: int, block_size: int) -> TraceRequest:
    prompt = count(line.get("prompt_tokens"), "prompt_tokens", 1)
    if line.get("block_size", block_size) != block_size:
        raise ValueError(f"block_size {line.get('block_size')} differs from the trace's {block_size}")
    ids = full_ids(line.get("prefix_hashes"), prompt, block_size, "prefix_hashes")
    if not all(type(i) in (int, str) for i in ids):
        raise ValueError("prefix_hashes must hold integers or strings")
    output = line.get("output_tokens")
    return TraceRequest(
        index=index,
        arrival=seconds(line.get("arrival_time", 0.0), "arrival_time"),
        prompt_tokens=prompt,
        output_tokens=0 if output is None else count(output, "output_tokens"),
        blocks=tuple(hash(i) if type(i) is int else stable_key(i) for i in ids),  # chained by the engine
    )


def _scaled(request: TraceRequest, scale: float) -> TraceRequest:
    """The request ``scale`` times sooner or later: its arrival and its think time alike."""
    return replace(request, arrival=request.arrival * scale, think=request.think * scale)


def _salt(line: dict[str, Any]) -> str | None:
    """A trace line's optional ``cache_salt``: a string, or none."""
    salt = line.get("cache_salt")
    if salt is not None and type(salt) is not str:
        raise ValueError("cache_salt must be a string")
    return salt or None


def _text(seconds: float) -> str:
    """Seconds to the millisecond, without trailing zeros: 86,400.001, 1,000,000,000,000."""
    return f"{seconds:,.3f}".rstrip("0").rstrip(".")
