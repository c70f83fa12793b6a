"""The session schedule of a replay: a conversation's next turn is sent when the answers it waits
for have ended, plus its recorded think time (closed loop per conversation), as agentic traffic
is sent; the timestamp schedule (``client.replay``) sends every request at its recorded time
whatever the answers do (open loop), which is the right test of Mooncake-like traffic and a
different workload from a conversation's.

A request waits for the requests of its ``after`` that are in the run (its session's previous
turn; a parent's turn after sub-agents waits for each sub-agent's last request; one left out of
the run, a warm-up's, is taken as answered) and then ``think * think_scale`` seconds; a request
that waits for none is due at its planned time (its conversation's start: the trace's offset,
``--session-rate``'s, or 0). Sub-agents waiting for the same parent turn are sent side by side.
At most ``max_sessions`` conversations (a session and its sub-agents) run at once: a conversation
takes a place at its first request and gives it back when its last answer has ended; one that
cannot start on time starts when a place frees, and its requests count as late by that much, as
every request sent past its time does.

A request that fails ends like an answer (its dependents go on): a conversation is not held
forever by one error, and the record says the error.

Salts (``--salt-per-session``, either schedule): each conversation's requests carry
``cache_salt`` ``{salt}-{conversation}`` (vLLM's field: a prefix cache shares blocks only between
requests of one salt), ``salt`` drawn afresh per run, so two replays of one trace at once share
nothing, and neither do two conversations of one replay whose block ids happen to agree.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvlens.experiment import calls
from kvlens.experiment.client import (
    CHAT,
    Endpoint,
    Planned,
    Progress,
    RecordWriter,
    chat_body,
    completions_body,
    send_planned,
    sleep_until,
)
from kvlens.experiment.prompts import PromptSynthesizer
from kvlens.experiment.stream import Exchange, StreamClient
from kvlens.simulate.trace import TraceRequest


@dataclass(frozen=True)
class SessionPlan:
    """How sessions are sent: think times scaled, conversations at once bounded."""

    think_scale: float = 1.0
    max_sessions: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.think_scale) and self.think_scale >= 0):
            raise ValueError("--think-scale must be a number >= 0")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError("--max-sessions must be at least 1")


def conversations(requests: Iterable[TraceRequest]) -> dict[str, str]:
    """Each session's conversation: the session a sub-agent's parent chain ends at."""
    parent: dict[str, str] = {}
    sessions: set[str] = set()
    for request in requests:
        if request.session is not None:
            sessions.add(request.session)
            if request.parent is not None and request.parent != request.session:
                parent.setdefault(request.session, request.parent)
    top = {}
    for session in sessions:
        root, steps = session, 0
        while root in parent and steps <= len(parent):  # a loop of parents ends where it began
            root, steps = parent[root], steps + 1
        top[session] = root
    return top


def conversation_of(request: TraceRequest, top: dict[str, str]) -> str:
    """The request's conversation; a request of no session is a conversation of its own."""
    if request.session is None:
        return f"request-{request.index}"
    return top.get(request.session, request.session)


def salted(planned: list[Planned], salt: str) -> list[Planned]:
    """``planned`` with each request's ``cache_salt``: ``{salt}-{its conversation}``."""
    top = conversations(p.request for p in planned)
    return [replace(p, salt=f"{salt}-{conversation_of(p.request, top)}") for p in planned]


async def replay_sessions(
    planned: list[Planned],
    prompts: PromptSynthesizer,
    endpoint: Endpoint,
    arm: str,
    writer: RecordWriter,
    plan: SessionPlan,
    progress: Progress | None = None,
) -> Progress:
    """Send ``planned`` by the session schedule; each request's record is written as it ends."""
    progress = progress or Progress()
    slots = asyncio.Semaphore(endpoint.max_concurrency)
    places = asyncio.Semaphore(plan.max_sessions) if plan.max_sessions else None
    client = StreamClient(
        endpoint.url,
        endpoint.headers,
        timeout=endpoint.timeout_seconds,
        connect_timeout=min(10.0, endpoint.timeout_seconds),
    )
    detokenizer = calls.client() if endpoint.api == CHAT else None
    by_index = {p.index: p for p in planned}
    top = conversations(p.request for p in planned)
    conversation = {p.index: conversation_of(p.request, top) for p in planned}
    remaining: dict[str, int] = {}
    for name in conversation.values():
        remaining[name] = remaining.get(name, 0) + 1
    started: set[str] = set()
    waiting = {p.index: sum(1 for i in p.request.after if i in by_index) for p in planned}
    dependents: dict[int, list[int]] = {}
    for p in planned:
        for i in p.request.after:
            if i in by_index:
                dependents.setdefault(i, []).append(p.index)
    ended: dict[int, float] = {}
    tasks: set[asyncio.Task[None]] = set()
    in_flight: set[asyncio.Future[Exchange]] = set()
    all_done = asyncio.Event()
    start = time.perf_counter()
    wall_start = time.time()

    def schedule(index: int, due: float) -> None:
        task = asyncio.ensure_future(send(by_index[index], due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def answered(index: int) -> None:
        """The answer to ``index`` ended (or failed): free what waited for it."""
        ended[index] = time.perf_counter()
        name = conversation[index]
        remaining[name] -= 1
        if remaining[name] == 0 and places is not None:
            places.release()
        for later in dependents.get(index, ()):
            waiting[later] -= 1
            if waiting[later] == 0:
                request = by_index[later].request
                last = max(ended[i] for i in request.after if i in by_index)
                schedule(later, last - start + request.think * plan.think_scale)
        if len(ended) == len(planned):
            all_done.set()

    async def send(request: Planned, due: float) -> None:
        name = conversation[request.index]
        deadline = start + due
        await sleep_until(deadline)
        if places is not None and name not in started:
            await places.acquire()
        started.add(name)
        tokens = prompts.tokens(request.request)
        body = (
            await chat_body(detokenizer, endpoint, tokens, request.output_tokens, request.salt)
            if detokenizer is not None
            else completions_body(endpoint.model, tokens, request.output_tokens, request.salt)
        )
        await slots.acquire()
        try:
            answer = send_planned(
                client,
                endpoint,
                arm,
                request,
                body,
                (start, deadline, wall_start),
                writer,
                progress,
                in_flight,
            )
            await asyncio.wait({answer})
        finally:
            slots.release()
        if not answer.cancelled():
            answered(request.index)

    try:
        if not planned:
            return progress
        for p in planned:
            if waiting[p.index] == 0:
                schedule(p.index, p.due)
        await all_done.wait()
    finally:
        for answer in list(in_flight):  # interrupted: what was in flight is not measured, not an error
            answer.cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
        if detokenizer is not None:
            await detokenizer.aclose()
    return progress
