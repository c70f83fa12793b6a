"""The simulated fleet stepped in real time: the replicas, caches and routing policies of
``kvlens simulate`` (:mod:`kvlens.simulate.replica`, :mod:`kvlens.simulate.policies`), driven by
the wall clock of one asyncio event loop instead of a trace's timestamps.

Virtual time is ``(wall - start) * speed``: the replicas live in it exactly as offline (a request
arrives at the virtual now, events are played in virtual order up to it before it is routed), so
a request's route, cached tokens and modelled timings are what an offline run of the same
arrivals gives. One timer (``loop.call_at``) wakes the loop at the earliest event any replica has
due; late wake-ups only delay when a client hears of an event, never its virtual time.

What a client hears: :class:`Ticket` futures resolve when its first token comes (prefill ended)
and when it finishes; between them, :meth:`Ticket.tokens_due` paces the output tokens by the
modelled decode step (a replica bound by its memory steps each decode and wakes its clients at
every step: :mod:`kvlens.simulate.memory`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import cast

from kvlens.simulate.cache import CacheEvents
from kvlens.simulate.replica import INF, Job
from kvlens.simulate.run import Fleet
from kvlens.simulate.serve.tokenizer import block_keys
from kvlens.simulate.trace import TraceRequest


class Ticket:
    """One prompt's way through the fleet, as its HTTP handler sees it."""

    __slots__ = ("aborted", "finished", "job", "left_waiting", "prompt_ids", "request_id", "started", "wake")

    def __init__(self, job: Job, prompt_ids: list[int], wake: asyncio.Event, request_id: str) -> None:
        self.job = job
        self.request_id = request_id
        self.aborted = False  # its client went away before it finished
        self.left_waiting = False  # ... before its prefill began
        self.prompt_ids = prompt_ids
        self.started = False  # its first token came
        self.finished = False
        self.wake = wake  # set on either (shared by the prompts of one HTTP request)

    def tokens_due(self, now: float) -> int:
        """Output tokens the client may have at virtual time ``now``: the first with the end of
        prefill, then one per modelled decode step, the last when the job finished."""
        job = self.job
        if self.finished:
            return job.output_tokens
        if not self.started:
            return 0
        if job.generated >= 0:  # stepped by a memory-bound replica: the tokens its steps made
            return max(1, min(job.generated, job.output_tokens - 1))
        if job.output_tokens <= 1:
            return 0  # its only token comes when it finishes
        step = (job.finish - job.first_token) / (job.output_tokens - 1)
        steps = int((now - job.first_token) / step) if step > 0 else job.output_tokens
        return max(1, min(1 + steps, job.output_tokens - 1))

    def next_token_at(self, emitted: int) -> float:
        """Virtual time of output token ``emitted + 1`` while it is paced by the decode step
        (INF: it waits for an event: the first token, or the finish)."""
        job = self.job
        if not self.started or emitted + 1 >= job.output_tokens or job.generated >= 0:
            return INF  # (stepped: each step wakes it)
        step = (job.finish - job.first_token) / (job.output_tokens - 1)
        return job.first_token + emitted * step


class RealTimeFleet:
    def __init__(
        self,
        fleet: Fleet,
        policy_name: str,
        *,
        speed: float = 1.0,
        prefix_caching: bool = True,
        honour_salt: bool = True,
        loop: asyncio.AbstractEventLoop | None = None,
        on_finish: Callable[[Ticket], None] | None = None,
        events: Callable[[int], CacheEvents] | None = None,
    ) -> None:
        """``events(i)``, when given, is told what replica i's cache stores and evicts (its KV
        events, published by ``--kv-events``). ``honour_salt`` False drops every request's
        ``cache_salt`` before its blocks are keyed (``--leak-salt``: an integration that loses
        the salt, as LMCache #4825 measured), so tenants share a cache scope."""
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError("--speed must be a positive number")
        self.fleet = fleet
        self.speed = speed
        self.prefix_caching = prefix_caching
        self.honour_salt = honour_salt
        self._loop = loop or asyncio.get_running_loop()
        self._start_wall = self._loop.time()
        self._done: list[Job] = []
        self._prefilled: list[Job] = []
        self.replicas, self._choose = fleet.build(policy_name, self._done, events)
        for replica in self.replicas:
            replica.prefilled = self._prefilled
        self._tickets: dict[int, Ticket] = {}  # id(job) -> ticket, while in flight
        self._order = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = INF
        self._on_finish = on_finish

    @property
    def in_flight(self) -> int:
        """Prompts submitted and not finished (waiting or running, in any replica)."""
        return len(self._tickets)

    def now(self) -> float:
        return (self._loop.time() - self._start_wall) * self.speed

    def wall_seconds(self, virtual_seconds: float) -> float:
        """A modelled duration as the client lives it."""
        return virtual_seconds / self.speed

    def wall_at(self, virtual: float) -> float:
        return self._start_wall + virtual / self.speed

    def submit(
        self,
        prompt_ids: list[int],
        output_tokens: int,
        wake: asyncio.Event,
        request_id: str,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> Ticket:
        """A prompt arrives now: it is routed and queued (the replica may start it at once). Its
        blocks are keyed under ``cache_salt`` and ``lora`` as offline
        (:func:`kvlens.simulate.trace.salted`)."""
        now = self.now()
        self._play(now)
        size = self.fleet.block_size
        blocks = block_keys(prompt_ids, size) if self.prefix_caching else _unshared(len(prompt_ids) // size)
        salt = cache_salt if self.honour_salt and self.prefix_caching else None
        lora = lora if self.prefix_caching else None
        request = TraceRequest(
            self._order, now, len(prompt_ids), output_tokens, blocks, cache_salt=salt, lora=lora
        )
        job = Job(request, self._order, self.fleet.block_size)
        if not self.prefix_caching:
            job.limit = 0
        self._order += 1
        ticket = Ticket(job, prompt_ids, wake, request_id)
        self._tickets[id(job)] = ticket
        self.replicas[self._choose(job, self.replicas, now)].enqueue(job, now)
        self._settle()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The client went away: the job leaves its replica now (see :meth:`Replica.abort`)."""
        if ticket.finished:
            return
        now = self.now()
        self._play(now)
        if ticket.finished:
            return
        ticket.aborted = True
        ticket.left_waiting = ticket.job.start == INF
        self.replicas[ticket.job.replica].abort(ticket.job, now)
        self._settle()

    def reset_prefix_cache(self) -> int:
        return sum(replica.cache.drop_free() for replica in self.replicas)

    def _play(self, until: float) -> None:
        for replica in self.replicas:
            if replica.due <= until:
                replica.advance(until)

    def _settle(self) -> None:
        """Tell the handlers what happened, then set the timer for the next event."""
        if self._prefilled:
            jobs = self._prefilled[:]
            self._prefilled.clear()
            for job in jobs:
                ticket = self._tickets[id(job)]
                ticket.started = True
                ticket.wake.set()
        if self._done:
            jobs = self._done[:]
            self._done.clear()
            for job in jobs:
                ticket = self._tickets.pop(id(job))
                ticket.started = ticket.finished = True
                ticket.wake.set()
                if self._on_finish is not None:
                    self._on_finish(ticket)
        due = min(replica.due for replica in self.replicas)
        if due < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due
            self._timer = self._loop.call_at(self.wall_at(due), self._tick) if due < INF else None

    def _tick(self) -> None:
        self._timer, self._timer_at = None, INF
        self._play(self.now())
        self._settle()


def _unshared(count: int) -> tuple[int, ...]:
    """Blocks no other request shares: without prefix caching a request still holds KV (so
    memory and eviction behave) but never finds or leaves anything reusable. (Fresh objects, not
    ints: nothing else can ever equal them; the cache only hashes and compares its keys.)"""
    return cast("tuple[int, ...]", tuple(object() for _ in range(count)))
