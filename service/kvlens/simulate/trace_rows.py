"""Line formats whose requests depend on earlier lines: Dynamo's agentic Mooncake rows and
BurstGPT's CSV. Each reader is made per pass over the file and reads one line at a time
(``trace.Trace`` gives them through the bounded line reader).

- **Agentic Mooncake** (ai-dynamo/dynamo, ``AgenticMooncakeRow`` of its data generator and its
  ``agent_trace_to_mooncake --agentic``): Mooncake's ``timestamp`` (ms), ``input_length``,
  ``output_length`` and ``hash_ids`` (already chained, as Mooncake's), plus ``request_id``,
  ``session_id`` (a trajectory: a sub-agent is a session of its own), ``wait_for[]`` (the request
  ids whose answers it waits for: its session's previous request, and at a join each sub-agent's
  last), ``branches[]`` (the sub-agents it starts; read from ``wait_for`` here), ``delay`` (ms
  after the last of those answers, tool time apart) and ``tool_wait_ms``. Rows without
  ``wait_for`` start at their ``timestamp``. The rows do not carry their block size (Dynamo's
  converter prints it): it is Mooncake's 512 unless ``--block-size`` says otherwise. A
  ``wait_for`` naming no earlier row is an error (the rows are written in start order, so a
  request's dependencies come before it).
- **BurstGPT** (HPMLL/BurstGPT): ``Timestamp`` (s), ``Model``, ``Request tokens``, ``Response
  tokens``, ``Total tokens``, ``Log Type``, and in ``BurstGPT_3`` ``Session ID`` and ``Elapsed
  time`` (s, the whole answer). It has **no hashes**: lengths and times only. Each request's
  blocks are its own (nothing is shared, so every prefix cache misses: a load of its lengths and
  arrivals, not of reuse); rows of one ``Session ID`` are a session (turn after turn, the think
  time the gap less the previous answer's ``Elapsed time``) even so.
"""

from __future__ import annotations

import csv
from typing import Any, Final

from kvlens.simulate.trace_request import (
    TraceRequest,
    chain,
    count,
    full_ids,
    integers,
    seconds,
)

MAX_ID_CHARS: Final = 256
BURSTGPT_COLUMNS: Final = ("Timestamp", "Request tokens", "Response tokens")


def _name(value: Any, field: str) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_ID_CHARS:
        raise ValueError(f"{field} must be a string of 1 to {MAX_ID_CHARS} characters")
    return value


def _alias(line: dict[str, Any], name: str, alias: str) -> Any:
    return line.get(name, line.get(alias))


class AgenticRows:
    """Dynamo's agentic Mooncake rows, one after the other."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}  # request id -> its row's index
        self._session: list[str] = []  # each row's session
        self._arrival: list[float] = []
        self._turns: dict[str, int] = {}

    def __call__(self, line: dict[str, Any], index: int, block_size: int) -> TraceRequest:
        request_id = _name(line.get("request_id"), "request_id")
        if request_id in self._index:
            raise ValueError(f"request_id {request_id!r} is on an earlier row too")
        session = line.get("session_id")
        session = request_id if session is None else _name(session, "session_id")
        prompt = count(_alias(line, "input_length", "input_tokens"), "input_length", 1)
        ids = integers(full_ids(line.get("hash_ids"), prompt, block_size, "hash_ids"), "hash_ids")
        waits = line.get("wait_for", [])
        if type(waits) is not list or len(waits) > 10_000:
            raise ValueError("wait_for must be a list of request ids")
        after = []
        for wait in waits:
            found = self._index.get(_name(wait, "wait_for"))
            if found is None:
                raise ValueError(f"wait_for names {wait!r}, which is on no earlier row")
            after.append(found)
        delay = _alias(line, "delay", "delay_ms")
        tool = line.get("tool_wait_ms")
        think = (0.0 if delay is None else seconds(delay, "delay")) + (
            0.0 if tool is None else seconds(tool, "tool_wait_ms")
        )
        turn = self._turns.get(session, 0)
        parents = {self._session[i] for i in after} - {session}
        parent = min(parents) if turn == 0 and parents else None
        arrival = max([seconds(_alias(line, "timestamp", "created_time"), "timestamp") / 1000.0] + [
            self._arrival[i] for i in after
        ])  # fmt: skip
        self._index[request_id] = index
        self._session.append(session)
        self._arrival.append(arrival)
        self._turns[session] = turn + 1
        return TraceRequest(
            index=index,
            arrival=arrival,
            prompt_tokens=prompt,
            output_tokens=count(_alias(line, "output_length", "output_tokens"), "output_length"),
            blocks=ids,
            session=session,
            turn=turn,
            parent=parent,
            after=tuple(after),
            think=think / 1000.0,
        )


def is_burstgpt(line: bytes) -> bool:
    header = _cells(line)
    return all(column in header for column in BURSTGPT_COLUMNS)


def _cells(line: bytes) -> list[str]:
    text = line.decode("utf-8", "replace").rstrip("\r\n")
    return next(csv.reader([text]), [])


class BurstRows:
    """BurstGPT's CSV rows after its header line."""

    def __init__(self) -> None:
        self._columns: dict[str, int] | None = None
        self._last: dict[str, tuple[int, float]] = {}  # session -> (index, recorded end)
        self._turns: dict[str, int] = {}

    def __call__(self, line: bytes, index: int, block_size: int) -> TraceRequest | None:
        cells = _cells(line)
        if self._columns is None:
            self._columns = {name: number for number, name in enumerate(cells)}
            return None  # the header
        if len(cells) != len(self._columns):
            raise ValueError(f"{len(cells)} cells where the header names {len(self._columns)}")

        def cell(name: str) -> str | None:
            assert self._columns is not None
            number = self._columns.get(name)
            return None if number is None else cells[number]

        at = seconds(_number(cell("Timestamp"), "Timestamp"), "Timestamp")
        prompt = count(_integer(cell("Request tokens"), "Request tokens"), "Request tokens", 1)
        # No hashes: blocks of this request alone (a start no other request has).
        blocks = chain(tuple(range(prompt // block_size)), (1 << 60) + index)  # (hash(-1) == hash(-2))
        session = cell("Session ID") or None
        after: tuple[int, ...] = ()
        think = 0.0
        turn = 0
        if session is not None:
            session = _name(session, "Session ID")
            turn = self._turns.get(session, 0)
            if session in self._last:
                previous, end = self._last[session]
                after, think = (previous,), max(0.0, at - end)
            elapsed = cell("Elapsed time")
            answer = seconds(_number(elapsed, "Elapsed time"), "Elapsed time") if elapsed else 0.0
            self._last[session] = (index, at + answer)
            self._turns[session] = turn + 1
        return TraceRequest(
            index=index,
            arrival=at,
            prompt_tokens=prompt,
            output_tokens=count(_integer(cell("Response tokens"), "Response tokens"), "Response tokens"),
            blocks=blocks,
            session=session,
            turn=turn,
            after=after,
            think=think,
        )


def _number(text: str | None, name: str) -> float:
    try:
        return float(text) if text is not None else float("nan")
    except ValueError:
        raise ValueError(f"{name} must be a number, not {text!r}") from None


def _integer(text: str | None, name: str) -> int:
    value = _number(text, name)
    if not value.is_integer():
        raise ValueError(f"{name} must be a whole number, not {text!r}")
    return int(value)
