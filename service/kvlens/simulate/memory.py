"""A replica whose KV memory decides who runs, stepped one decode step at a time, as vLLM's V1
scheduler does (``reference/engines.md``, "Simulating the scheduler").

- **Memory.** ``kv_blocks`` sizes it as vLLM does: ``(GPU memory x utilisation - weights) /
  bytes per block``, a block ``block_size x c`` bytes (``c = 2*L*Hkv*D*bytes``,
  :attr:`kvlens.shapes.ModelShape.kv_bytes_per_token`). The prefix cache lives in it: cached
  blocks nobody holds are free memory, evicted when a request needs room.
- **Admission.** The waiting line is FIFO: its head starts when the prefill lane is free, fewer
  than ``max_running`` requests run, and its blocks fit (all its tokens, less the leading blocks
  running requests already hold); else it and everyone behind it wait (vLLM's FCFS stops at the
  first request it cannot schedule).
- **Decode.** Every running request makes one token per step. Before a step each gets the blocks
  its tokens need, oldest first; when none are left the newest running request is preempted
  (recompute: its blocks are freed, it goes to the front of the line, and when it starts again
  its prompt and the tokens it had made are prefilled again, the prompt's cached prefix reused).
  A step takes ``t0 + (W + sum of the running requests' tokens x c) / BW``
  (:meth:`kvlens.simulate.replica.DecodeModel.step_seconds`, the byte model of
  :mod:`kvlens.bandwidth`); a request whose prefill ends during a step joins the next one.
- Prefill is as in :class:`~kvlens.simulate.replica.Replica`: one at a time, ``C(n) - C(h)``
  seconds, decodes going on beside it (chunked prefill) or paused for it.

A request keeps the hit, start and first token of its first admission (vLLM's records do).
"""

from __future__ import annotations

import math

from kvlens.simulate.cache import CacheEvents
from kvlens.simulate.replica import INF, Job, Replica, ServiceModel


def kv_blocks(
    gpu_memory_bytes: float,
    utilization: float,
    weight_bytes: float,
    kv_bytes_per_token: float,
    block_size: int,
) -> int:
    """KV blocks of one replica as vLLM sizes them: ``(M x utilisation - W) / (block_size x c)``
    (vLLM also subtracts the activations' peak, which a simulation does not have). Raises
    ValueError when the weights leave no room."""
    if not (0 < utilization <= 1):
        raise ValueError("--gpu-memory-utilization takes a share in (0, 1]")
    room = gpu_memory_bytes * utilization - weight_bytes
    blocks = math.floor(room / (block_size * kv_bytes_per_token)) if room > 0 else 0
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {gpu_memory_bytes:.4g} bytes x {utilization:g} leave "
            f"{room:.4g} bytes beside {weight_bytes:.4g} bytes of weights, under one block of "
            f"{block_size * kv_bytes_per_token:.4g} bytes"
        )
    return blocks


def make_replica(
    index: int,
    capacity_blocks: int | None,
    block_size: int,
    model: ServiceModel,
    done: list[Job],
    events: CacheEvents | None = None,
) -> Replica:
    """The replica the service model asks for: bound by its memory, or by its prefix cache only."""
    if model.admit_by_memory:
        if capacity_blocks is None:
            raise ValueError("a replica bound by its memory needs a block count")
        return MemoryReplica(index, capacity_blocks, block_size, model, done, events)
    return Replica(index, capacity_blocks, block_size, model, done, events)


class MemoryReplica(Replica):
    __slots__ = ("_joining", "_running", "step_end")

    def __init__(
        self,
        index: int,
        capacity_blocks: int,
        block_size: int,
        model: ServiceModel,
        done: list[Job],
        events: CacheEvents | None = None,
    ) -> None:
        super().__init__(index, capacity_blocks, block_size, model, done, events)
        self._running: list[Job] = []  # decoding, in the order they began (the last is preempted)
        self._joining: list[Job] = []  # prefilled during the step under way: in the next one
        self.step_end = INF

    @property
    def running(self) -> int:
        return len(self._running) + len(self._joining) + (self.prefilling is not None)

    def enqueue(self, job: Job, now: float) -> None:
        job.generated = 0
        super().enqueue(job, now)

    def advance(self, until: float) -> None:
        while True:
            due = min(self.step_end, self.prefill_end)
            if due > until or due == INF:
                self.due = due
                return
            if self.prefill_end <= self.step_end:
                self._first_token(self.prefill_end)
            else:
                self._step(self.step_end)

    def abort(self, job: Job, now: float) -> None:
        if job.finish <= now or job.replica != self.index:
            return
        if job is self.prefilling:
            job.output_tokens = job.generated + 1  # it ends with the token its prefill makes
            return
        if job in self._running or job in self._joining:
            self._finish(job, now)
            self._start(now)
            self._plan_step(now)
            return
        # waiting (never started, or preempted): marked by its finish, dropped when at the front
        if job.start == INF:
            job.start = job.first_token = now
        job.finish = now
        self._left += 1
        if self._left * 2 > len(self.waiting):
            self.waiting = type(self.waiting)(w for w in self.waiting if w.finish == INF)
            self._left = 0
        self.backlog = max(self.backlog - job.estimate, 0.0) if self.queued else 0.0
        self.done.append(job)

    # --- the scheduler ----------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _start(self, now: float) -> None:
        """Admit the head of the line while it fits (one prefill at a time)."""
        waiting, cache = self.waiting, self.cache
        while waiting and waiting[0].finish != INF:  # left while waiting
            waiting.popleft()
            self._left -= 1
        if self.prefilling is not None or not waiting or self.running >= self.model.max_running:
            return
        job = waiting[0]
        tokens = job.prompt_tokens + job.generated  # a preempted request prefills its output too
        shared = cache.held_prefix(job.blocks, len(job.blocks))
        available = cache.available()
        if available is not None and self._blocks_for(tokens) - shared > available:
            return  # it waits for memory, and everyone behind it
        waiting.popleft()
        self.backlog = self.backlog - job.estimate if self.queued else 0.0
        reused, job.held = cache.acquire(job.blocks, job.limit, job.scope)
        job.private = self._blocks_for(tokens) - job.held
        taken = cache.reserve(job.private)
        assert taken, "admission checked the room"
        if job.start == INF:  # the first admission fixes the hit, the start
            job.start = now
            job.cached_tokens = reused * self.block_size
        duration = self._prefill_seconds(tokens, reused * self.block_size)
        self.busy_seconds += duration
        self.prefilling = job
        self.prefill_end = now + duration
        self.due = min(self.due, self.prefill_end)
        if not self.model.chunked_prefill and self.step_end < INF:  # the prefill pauses decode
            self.step_end += duration

    def _first_token(self, now: float) -> None:
        job = self.prefilling
        assert job is not None
        self.prefilling = None
        self.prefill_end = INF
        job.generated += 1  # a prefill samples one token
        if job.first_token == INF:
            job.first_token = now
            self.served += 1
        if self.prefilled is not None:
            self.prefilled.append(job)
        if job.generated >= job.output_tokens:
            self._free(job)
            job.finish = now
            self.done.append(job)
        elif self.step_end < INF:
            self._joining.append(job)
        else:
            self._running.append(job)
            self._plan_step(now)
        self._start(now)

    def _step(self, now: float) -> None:
        """A decode step ends: a token for each request in it; the finished leave."""
        self.step_end = INF
        stepped = self._running
        for job in stepped:
            job.generated += 1
        if self.prefilled is not None:  # their clients are told of the token
            self.prefilled.extend(stepped)
        for job in [job for job in stepped if job.generated >= job.output_tokens]:
            self._finish(job, now)
        self._running.extend(self._joining)
        self._joining.clear()
        self._start(now)
        self._plan_step(now)

    def _plan_step(self, now: float) -> None:
        """The next step, unless one is under way: blocks for each running request's tokens,
        oldest first, preempting the newest while memory is short; then its duration."""
        if self.step_end < INF:
            return
        running, cache = self._running, self.cache
        index = 0
        while index < len(running):
            job = running[index]
            need = self._blocks_for(job.prompt_tokens + job.generated) - job.held - job.private
            while need > 0 and not cache.reserve(need):
                self._preempt(running[-1])
                if index >= len(running):  # it preempted itself
                    break
            else:
                job.private += max(need, 0)
                index += 1
        if not running:
            return
        context = sum(job.prompt_tokens + job.generated for job in running)
        batch = len(running)
        self.step_end = now + self._step_seconds(batch, context / batch)
        self.due = min(self.due, self.step_end)

    def _preempt(self, job: Job) -> None:
        self._running.remove(job)
        self._free(job)
        self.preemptions += 1
        self.waiting.appendleft(job)
        self.backlog += job.estimate

    def _free(self, job: Job) -> None:
        self.cache.release(job.blocks, job.held)
        self.cache.unreserve(job.private)
        job.held = job.private = 0

    def _finish(self, job: Job, now: float) -> None:
        (self._running if job in self._running else self._joining).remove(job)
        self._free(job)
        job.finish = now
        self.done.append(job)
