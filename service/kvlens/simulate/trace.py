"""Request traces for the simulator: Mooncake, Alibaba Bailian (Qwen) and kvlens records.

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

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from kvlens.errors import InputError
from kvlens.records import MAX_TOKENS
from kvlens.sources import jsonlines

MOONCAKE: Final = "mooncake"
BAILIAN: Final = "bailian"
KVLENS: Final = "kvlens"
FORMATS: Final = (MOONCAKE, BAILIAN, KVLENS)
BLOCK_SIZES: Final = {MOONCAKE: 512, BAILIAN: 16}  # kvlens records carry theirs
MAX_GAP_SECONDS: Final = 86_400.0
_CHUNK_BYTES: Final = 1024 * 1024  # read at a time (a trace line is a few KiB)
# The Mooncake synthetic trace (kvcache-ai/Mooncake, Apache-2.0; data/NOTICE), bundled for
# `kvlens demo` and for `kvlens simulate` without a trace.
BUNDLED: Final = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"


# A request's cache scope beside its content, as an engine's KV events publish it: its cache salt
# and its LoRA adapter (either may be None).
Scope = tuple[str | None, str | None]


class TraceError(InputError):
    """A trace line that is not a request of the trace's format."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # position in the trace (ties in arrival time keep this order)
    arrival: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]  # keys of the prompt's full blocks, each standing for its prefix
    # vLLM's ``cache_salt`` (None: unsalted): mixed into the first block's key, so the keys a
    # cache sees are :attr:`keys`, never ``blocks`` (which the experiment's prompts are made from)
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter it runs on (``simulate serve --lora-modules``)

    @property
    def scope(self) -> Scope | None:
        """The cache scope its blocks are keyed in beside their content: (salt, LoRA), or None."""
        return (self.cache_salt, self.lora) if self.cache_salt or self.lora else None

    @property
    def keys(self) -> tuple[int, ...]:
        """The blocks as the engine keys them: :func:`salted` by the request's ``cache_salt`` and
        LoRA."""
        return salted(self.blocks, self.cache_salt, self.lora)


@dataclass(frozen=True)
class Trace:
    path: str
    format: str
    block_size: int
    time_scale: float = 1.0

    def requests(self) -> Iterator[TraceRequest]:
        """The requests in arrival order, read as they are needed (kvlens records: all at once)."""
        numbered = self._numbered()
        if self.format == KVLENS:
            numbered = iter(sorted(numbered, key=lambda item: (item[1].arrival, item[1].index)))
        last = None
        for number, request in numbered:
            if last is not None and request.arrival - last > MAX_GAP_SECONDS:
                field = "arrival_time" if self.format == KVLENS else "timestamp"
                raise TraceError(
                    f"{self.path} line {number}: {field} is {_text(request.arrival - last)} s after the "
                    f"request before it; a gap over {MAX_GAP_SECONDS:,.0f} s (a day) is refused: a replay "
                    "would wait that long for its next request (a timestamp in the wrong unit, or out of "
                    "place?)"
                )
            last = request.arrival
            yield request if self.time_scale == 1.0 else _scaled(request, self.time_scale)

    def _numbered(self) -> Iterator[tuple[int, TraceRequest]]:
        """Each request and its line, in the file's order."""
        parse = {MOONCAKE: _mooncake, BAILIAN: _bailian, KVLENS: _kvlens}[self.format]
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
            if self.format != KVLENS and request.arrival < last:
                raise TraceError(
                    f"{self.path} line {number}: timestamp goes back in time "
                    f"({request.arrival:g} s after {last:g} s); sort the trace by timestamp"
                )
            last = request.arrival
            yield number, request
            index += 1


def open_trace(
    path: str | Path, *, block_size: int | None = None, time_scale: float = 1.0, rate: float | None = None
) -> Trace:
    """The trace at ``path``, its format told by its first line. Its block size is the format's
    (Mooncake 512, Bailian 16) or the records' ``block_size``; a different ``block_size`` is
    refused, since the trace's hashes were made at its own. ``time_scale`` multiplies arrival
    times (0.5: the same requests twice as fast); ``rate`` (requests per second) sets the
    scale so that the whole trace arrives at that mean rate (one extra pass over the file)."""
    name = str(path)
    first = _first_line(name)
    kind = _detect(first, name)
    found = BLOCK_SIZES.get(kind) or _records_block_size(first, block_size, name)
    if block_size is not None and block_size != found:
        raise TraceError(
            f"{name}: the trace's blocks are {found} tokens, not --block-size {block_size}: its hashes "
            "were made at its own block size and cannot be re-cut"
        )
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise TraceError("time scale must be a positive number")
    trace = Trace(name, kind, found, time_scale)
    if rate is not None:
        if not (math.isfinite(rate) and rate > 0):
            raise TraceError("rate must be a positive number of requests per second")
        count, span = 0, 0.0
        for request in Trace(name, kind, found).requests():
            count, span = count + 1, request.arrival
        if count < 2 or span <= 0:
            raise TraceError(f"{name}: a rate needs two or more requests spread over time")
        trace = Trace(name, kind, found, time_scale * (count - 1) / (span * rate))
    return trace


def _first_line(path: str) -> bytes:
    for _, line in _lines(path):
        if line.strip():
            return line
    raise TraceError(f"{path}: the trace is empty")


def _detect(line: bytes, path: str) -> str:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as error:
        raise TraceError(f"{path} line 1: not JSON ({error})") from None
    if isinstance(value, dict):
        if "hash_ids" in value and "chat_id" in value:
            return BAILIAN
        if "hash_ids" in value:
            return MOONCAKE
        if "prefix_hashes" in value and "prompt_tokens" in value:
            return KVLENS
    raise TraceError(
        f"{path} line 1: not a trace kvlens reads: a Mooncake line (timestamp, input_length, "
        "output_length, hash_ids), a Bailian one (chat_id, parent_chat_id, ... hash_ids) or a kvlens "
        "record with prefix_hashes"
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


def _count(value: Any, name: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= MAX_TOKENS:
        raise ValueError(f"{name} must be an integer between {low} and {MAX_TOKENS:,}")
    return value


def _seconds(value: Any, name: str) -> float:
    if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0")
    return float(value)


def _ids(value: Any, prompt_tokens: int, block_size: int, name: str) -> list[Any]:
    if type(value) is not list:
        raise ValueError(f"{name} must be a list")
    full, every = prompt_tokens // block_size, -(-prompt_tokens // block_size)
    if len(value) not in (full, every):
        raise ValueError(
            f"{name} has {len(value)} blocks; {prompt_tokens} tokens make {full} full blocks "
            f"({every} with the partial last one) of {block_size}"
        )
    return value[:full]


def _integers(ids: list[Any], name: str) -> tuple[int, ...]:
    if not all(type(i) is int for i in ids):
        raise ValueError(f"{name} must hold integers")
    return tuple(ids)


def _mooncake(line: dict[str, Any], index: int, block_size: int) -> TraceRequest:
    prompt = _count(line.get("input_length"), "input_length", 1)
    ids = _ids(line.get("hash_ids"), prompt, block_size, "hash_ids")
    return TraceRequest(
        index=index,
        arrival=_seconds(line.get("timestamp"), "timestamp") / 1000.0,
        prompt_tokens=prompt,
        output_tokens=_count(line.get("output_length"), "output_length"),
        blocks=_integers(ids, "hash_ids"),
        cache_salt=_salt(line),
    )


def _bailian(line: dict[str, Any], index: int, block_size: int) -> TraceRequest:
    prompt = _count(line.get("input_length"), "input_length", 1)
    ids = _integers(_ids(line.get("hash_ids"), prompt, block_size, "hash_ids"), "hash_ids")
    chat, parent = line.get("chat_id"), line.get("parent_chat_id")
    if type(chat) is not int or type(parent) is not int or parent < -1:
        raise ValueError("chat_id and parent_chat_id must be integers (parent_chat_id -1 for a first turn)")
    return TraceRequest(
        index=index,
        arrival=_seconds(line.get("timestamp"), "timestamp"),
        prompt_tokens=prompt,
        output_tokens=_count(line.get("output_length"), "output_length"),
        blocks=chain(ids),  # a later turn shares its chat's blocks through them, not through the ids
        cache_salt=_salt(line),
    )


def _kvlens(line: dict[str, Any], index: int, block_size: int) -> TraceRequest:
    prompt = _count(line.get("prompt_tokens"), "prompt_tokens", 1)
    if line.get("block_size", block_size) != block_size:
        raise ValueError(f"block_size {line.get('block_size')} differs from the trace's {block_size}")
    ids = _ids(line.get("prefix_hashes"), prompt, block_size, "prefix_hashes")
    if not all(type(i) in (int, str) for i in ids):
        raise ValueError("prefix_hashes must hold integers or strings")
    output = line.get("output_tokens")
    return TraceRequest(
        index=index,
        arrival=_seconds(line.get("arrival_time", 0.0), "arrival_time"),
        prompt_tokens=prompt,
        output_tokens=0 if output is None else _count(output, "output_tokens"),
        blocks=tuple(hash(i) if type(i) is int else _stable_key(i) for i in ids),  # chained by the engine
    )


def _stable_key(text: str) -> int:
    """A string hash as a key, the same in every process: Python's ``hash(str)`` is salted per
    process, and arms replayed in separate processes must send the same prompts."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def chain(ids: tuple[int, ...], start: int = 0) -> tuple[int, ...]:
    """Keys that stand for each block and everything before it: ``key[i] = hash((key[i-1], id[i]))``,
    ``key[-1]`` being ``start``."""
    keys = []
    key = start
    for block in ids:
        key = hash((key, block))
        keys.append(key)
    return tuple(keys)


def salted(blocks: tuple[int, ...], salt: str | None, lora: str | None = None) -> tuple[int, ...]:
    """``blocks`` (chained keys) as a cache keys them under ``salt`` and ``lora``, as vLLM 0.33
    does: the salt is mixed into the first block's key only (``generate_block_hash_extra_keys``
    adds it where ``start_token_idx == 0``) and every later key inherits it through the chain, so
    two salts never share a block and one salt shares all of a common prefix. vLLM mixes a LoRA's
    name into every block; through the chain, mixing it into the first gives the same sharing.
    No salt (None or empty: vLLM tests ``if request.cache_salt``) and no LoRA leave the keys as
    they are. They enter as a stable digest (Python's ``hash(str)`` changes per process; records
    carry these keys)."""
    if not salt and not lora:
        return blocks
    return chain(blocks, _stable_key(f"cache_salt\0{salt or ''}\0lora\0{lora or ''}"))


def _salt(line: dict[str, Any]) -> str | None:
    """A trace line's optional ``cache_salt``: a string, or none."""
    salt = line.get("cache_salt")
    if salt is not None and type(salt) is not str:
        raise ValueError("cache_salt must be a string")
    return salt or None


def _scaled(request: TraceRequest, scale: float) -> TraceRequest:
    return TraceRequest(
        request.index,
        request.arrival * scale,
        request.prompt_tokens,
        request.output_tokens,
        request.blocks,
        request.cache_salt,
        request.lora,
    )


def _text(seconds: float) -> str:
    """Seconds to the millisecond, without trailing zeros: 86,400.001, 1,000,000,000,000."""
    return f"{seconds:,.3f}".rstrip("0").rstrip(".")
