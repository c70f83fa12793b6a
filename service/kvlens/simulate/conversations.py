"""kv-cache-tester conversation files (callanjfox/kv-cache-tester, ``traces/``; its
``docs/trace_replay_tester.md``): one JSON object per conversation, a file or a directory of them.

A file holds ``block_size`` (64 in the published traces), ``hash_id_scope`` (``local``: its ids
mean something in this conversation only; ``global``: across conversations), ``tool_tokens``,
``system_tokens`` and ``requests[]``, each with ``t`` (seconds from the conversation's start),
``in``, ``out``, ``hash_ids`` (one per 64-token block, the partial last one included), ``stop``,
and in newer files ``api_time`` (the recorded answer's duration) and ``think_time`` (the user's or
the tool's time before the request). A ``type: "subagent"`` entry starts a sub-agent at its ``t``
with its own ``requests[]`` (their ``t`` from the sub-agent's start); consecutive sub-agent entries
run side by side and the parent's next request waits for all of them, as kv-cache-tester replays
them.

Read here:

- ids are chained (``chain``) from a start that is the conversation's own when the scope is local,
  so that block 7 of one conversation is not block 7 of another, while sub-agents of one
  conversation share their common tool prefix, as they do in the trace;
- each request's ``after`` is its session's previous request (for a sub-agent's first request,
  the parent's request before it; for the parent's request after sub-agents, each sub-agent's
  last), ``think`` its ``think_time``, else its ``t`` gap after those requests' recorded ends
  (``t + api_time``; ``t`` alone when ``api_time`` is absent, so the gap then holds the answer);
- ``arrival`` is the recorded time, at or after every request it waits for; conversations start
  at 0 (the files record no offset between conversations), or one every ``1 / session_rate``
  seconds in file-name order.

Bounds: a file of more than ``jsonlines.MAX_LINE_BYTES`` (64 MiB) is refused without being held
(a compact file is one line), a directory of more than :data:`MAX_FILES` files too, sub-agents
nested deeper than :data:`MAX_DEPTH`; counts are checked as every trace's are
(``trace_request.count``). The requests of all conversations are held in memory (they are sorted
by arrival across conversations), about the size of their hash ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import orjson

from kvlens.simulate.trace_request import (
    TraceError,
    TraceRequest,
    chain,
    count,
    full_ids,
    integers,
    seconds,
    stable_key,
)
from kvlens.sources import jsonlines

MAX_FILES: Final = 10_000
MAX_DEPTH: Final = 8  # sub-agents of sub-agents ...; the published traces nest one level
SUFFIXES: Final = (".json", ".json.gz")


def is_conversation(first: bytes, path: str) -> bool:
    """Whether the file whose first line is ``first`` is a conversation: a JSON object holding
    ``requests[]`` and ``block_size`` on that line (a compact file is one line), or a line that
    opens an object without closing it (a file written with indents), whose whole is then read."""
    try:
        value = orjson.loads(first)
    except orjson.JSONDecodeError:
        if not first.lstrip().startswith(b"{"):
            return False
        try:
            value = _load(Path(path))
        except TraceError:
            return False
    return isinstance(value, dict) and isinstance(value.get("requests"), list) and "block_size" in value


def files(path: str) -> list[Path]:
    """The conversation files at ``path``: the file, or the directory's ``*.json(.gz)`` by name."""
    where = Path(path)
    if not where.is_dir():
        return [where]
    found: list[Path] = []
    for entry in sorted(where.iterdir()):
        if entry.is_file() and entry.name.endswith(SUFFIXES):
            found.append(entry)
            if len(found) > MAX_FILES:
                raise TraceError(f"{path}: more than {MAX_FILES:,} conversation files; split the directory")
    if not found:
        raise TraceError(f"{path}: no conversation file (*.json, *.json.gz) in the directory")
    return found


def block_size(path: str) -> int:
    """The conversations' block size (every file must agree)."""
    sizes = {_block_size(_load(each), each) for each in files(path)}
    if len(sizes) > 1:
        raise TraceError(f"{path}: conversations of different block sizes {sorted(sizes)}: replay them apart")
    return sizes.pop()


def _block_size(value: Any, path: Path) -> int:
    size = value.get("block_size") if isinstance(value, dict) else None
    if type(size) is not int or not 1 <= size <= 1 << 20:
        raise TraceError(f"{path}: block_size must be a positive integer (kv-cache-tester writes 64)")
    return size


def _load(path: Path) -> Any:
    """The file's JSON, read through the bounded reader: past MAX_LINE_BYTES it is refused."""
    limit = jsonlines.MAX_LINE_BYTES
    try:
        with jsonlines.open_file(str(path)) as stream:
            data = stream.read(limit + 1)
    except (OSError, EOFError) as error:
        raise TraceError(f"{path}: cannot read: {error}") from None
    if len(data) > limit:
        raise TraceError(f"{path}: longer than {limit:,} bytes: not read")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise TraceError(f"{path}: not JSON ({error})") from None


@dataclass
class _Walk:
    """Requests of one conversation as they are met, numbered in the order met (which is an order
    where every request comes after those it waits for)."""

    block_size: int
    start: int  # the chain's namespace
    offset: float  # the conversation's start, seconds
    requests: list[TraceRequest] = field(default_factory=list)
    sessions: set[str] = field(default_factory=set)

    def entries(
        self,
        entries: Any,
        base: float,
        session: str,
        parent: str | None,
        after: tuple[int, ...],
        after_end: float,
        depth: int,
    ) -> tuple[tuple[int, ...], float]:
        """Read one session's entries; return its last requests and their recorded end."""
        if type(entries) is not list:
            raise ValueError(f"{session}: requests must be a list")
        if depth > MAX_DEPTH:
            raise ValueError(f"{session}: sub-agents nested deeper than {MAX_DEPTH}")
        self.sessions.add(session)
        turn = 0
        position = 0
        while position < len(entries):
            entry = entries[position]
            if type(entry) is not dict:
                raise ValueError(f"{session} request {position}: not a JSON object")
            if entry.get("type") == "subagent":
                group_end, lasts = after_end, list[int]()
                while position < len(entries) and _is_subagent(entries[position]):
                    sub = entries[position]
                    name = self._name(f"{session}/{sub.get('agent_id') or position}")
                    begin = base + seconds(sub.get("t", 0.0), f"{name}: t")
                    last, end = self.entries(
                        sub.get("requests"), begin, name, session, after, after_end, depth + 1
                    )
                    if last != after:  # a sub-agent with requests
                        lasts.extend(last)
                        group_end = max(group_end, end)
                    position += 1
                if lasts:
                    after, after_end = tuple(lasts), group_end
                continue
            after, after_end = self._request(entry, base, session, parent, turn, after, after_end, position)
            turn += 1
            position += 1
        return after, after_end

    def _request(
        self,
        entry: dict[str, Any],
        base: float,
        session: str,
        parent: str | None,
        turn: int,
        after: tuple[int, ...],
        after_end: float,
        position: int,
    ) -> tuple[tuple[int, ...], float]:
        where = f"{session} request {position}"
        at = base + seconds(entry.get("t"), f"{where}: t")
        prompt = count(entry.get("in"), f"{where}: in", 1)
        ids = full_ids(entry.get("hash_ids"), prompt, self.block_size, f"{where}: hash_ids")
        keys = chain(integers(ids, f"{where}: hash_ids"), self.start)
        think = entry.get("think_time")
        answer = entry.get("api_time")
        waited = seconds(think, f"{where}: think_time") if think is not None else max(0.0, at - after_end)
        arrival = max([at + self.offset, *(self.requests[i].arrival for i in after)])
        order = len(self.requests)
        self.requests.append(
            TraceRequest(
                index=order,
                arrival=arrival,
                prompt_tokens=prompt,
                output_tokens=count(entry.get("out"), f"{where}: out"),
                blocks=keys,
                session=session,
                turn=turn,
                parent=parent,
                after=after,
                think=waited,
            )
        )
        end = at + (seconds(answer, f"{where}: api_time") if answer is not None else 0.0)
        return (order,), end

    def _name(self, name: str) -> str:
        unique, number = name, 1
        while unique in self.sessions:
            number += 1
            unique = f"{name}#{number}"
        return unique


def _is_subagent(entry: Any) -> bool:
    return type(entry) is dict and entry.get("type") == "subagent"


def read(path: str, block: int, session_rate: float | None = None) -> list[TraceRequest]:
    """Every request of the conversations at ``path``, in arrival order (ties: the order met,
    which keeps each request after those it waits for), numbered from 0."""
    if session_rate is not None and not (math.isfinite(session_rate) and session_rate > 0):
        raise TraceError("--session-rate must be a positive number of conversations per second")
    every: list[TraceRequest] = []
    names: set[str] = set()
    for number, each in enumerate(files(path)):
        value = _load(each)
        if _block_size(value, each) != block:
            raise TraceError(f"{each}: block_size {value.get('block_size')} differs from the trace's {block}")
        name = value.get("id") if isinstance(value.get("id"), str) and value.get("id") else each.name
        name = name[:200]
        unique, copy = name, 1
        while unique in names:
            copy += 1
            unique = f"{name}#{copy}"
        names.add(unique)
        scope = value.get("hash_id_scope", "local")
        start = 0 if scope == "global" else stable_key(unique)
        offset = number / session_rate if session_rate else 0.0
        walk = _Walk(block, start, offset)
        try:
            walk.entries(value.get("requests"), 0.0, unique, None, (), 0.0, 0)
        except (ValueError, TypeError) as error:
            raise TraceError(f"{each}: {error}") from None
        first = len(every)
        every.extend(
            replace(r, index=first + r.index, after=tuple(first + i for i in r.after)) for r in walk.requests
        )
    return renumbered(every)


def renumbered(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The requests sorted by (arrival, index), renumbered from 0, ``after`` following them."""
    ordered = sorted(requests, key=lambda r: (r.arrival, r.index))
    position = {r.index: number for number, r in enumerate(ordered)}
    return [replace(r, index=n, after=tuple(position[i] for i in r.after)) for n, r in enumerate(ordered)]


def numbered(path: str, block: int, session_rate: float | None) -> Iterator[tuple[int, TraceRequest]]:
    """(request number, request): a conversation has no lines to name, so errors name the file."""
    for request in read(path, block, session_rate):
        yield request.index + 1, request
