"""A replica that queues: its prefix cache, a waiting line, one prefill at a time, and the
requests it decodes.

The service model, documented in the README:

- A request waits (FIFO) until the replica's prefill lane is free and fewer than
  ``max_running`` requests hold KV there. It then takes its cached prefix from the cache (the
  hit is fixed when prefill starts, as vLLM's scheduler fixes it) and holds its blocks until it
  finishes.
- Prefill takes the remaining work ``C(n) - C(h)`` of the cost model in seconds
  (:meth:`kvlens.definitions.CostModel.remaining_work`); its end is the first token, so
  TTFT = queue + prefill.
- Each further output token takes one decode step at the batch the replica runs when the
  request's decode begins: ``t0 + (W + B*K) / BW`` (:mod:`kvlens.bandwidth`, ``K`` the KV bytes
  of the mean running context).
- With chunked prefill (vLLM V1's default) decodes go on while a prefill runs; without it, a
  prefill pauses every running decode for its duration.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from heapq import heapify, heappop, heappush

from kvlens import bandwidth
from kvlens.definitions import CostModel
from kvlens.simulate.cache import CacheEvents, PrefixCache, hit_limit
from kvlens.simulate.trace import TraceRequest

INF = math.inf

# An H200 serving the Llama-3.1-8B shape (tests/fixtures/h200, scaled from the measured layers to
# 32): prefill a = 2.32e-5 s per token, b = 1.70e-9 s per causal pair; decode t0 1.7 ms, 16.1 GB
# of bf16 weights and 128 KiB of KV per token read at 3.27 TB/s.
H200_LLAMA_8B_PREFILL = CostModel(a=2.32e-5, b=1.70e-9, unit="seconds")


@dataclass(frozen=True)
class DecodeModel:
    step_overhead_seconds: float = 1.7e-3
    weight_bytes: float = 16.06e9
    kv_bytes_per_token: float = 131_072
    bandwidth_bytes_per_second: float = 3.27e12

    def step_seconds(self, batch: int, mean_context_tokens: float) -> float:
        read = bandwidth.step_bytes(self.weight_bytes, batch, mean_context_tokens * self.kv_bytes_per_token)
        return bandwidth.step_seconds(read, self.bandwidth_bytes_per_second, extra=self.step_overhead_seconds)


@dataclass(frozen=True)
class ServiceModel:
    prefill: CostModel = H200_LLAMA_8B_PREFILL
    decode: DecodeModel = DecodeModel()
    max_running: int = 256
    chunked_prefill: bool = True
    # The replica's KV memory (its capacity blocks) bounds admission and decode, step by step, as
    # vLLM's scheduler does (:mod:`kvlens.simulate.memory`); False: it bounds only the prefix cache.
    admit_by_memory: bool = False

    def __post_init__(self) -> None:
        if self.prefill.unit != "seconds":
            raise ValueError(
                f"the simulator needs prefill times: a cost model in seconds, not {self.prefill.unit} "
                "(calibrate one with kvlens analyze --calibrate)"
            )
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")


DEFAULT_SERVICE = ServiceModel()


class Job:
    """A request on its way through a replica."""

    __slots__ = (
        "arrival",
        "blocks",
        "cached_tokens",
        "estimate",
        "finish",
        "first_token",
        "generated",
        "held",
        "index",
        "limit",
        "order",
        "output_tokens",
        "private",
        "prompt_tokens",
        "replica",
        "scope",
        "start",
    )

    def __init__(self, request: TraceRequest, order: int, block_size: int) -> None:
        self.index = request.index
        self.order = order  # arrival order in this run: ties are broken by it
        self.arrival = request.arrival
        self.prompt_tokens = request.prompt_tokens
        self.output_tokens = request.output_tokens
        self.blocks = request.keys  # salted as the engine keys them
        self.scope = request.scope  # and published with its stores, as the engine's KV events do
        self.limit = hit_limit(request.prompt_tokens, block_size)
        self.estimate = 0.0  # the prefill seconds the router expected here
        self.replica = -1
        self.cached_tokens = 0
        self.held = 0
        # Stepped by a memory-bound replica: output tokens so far, and blocks held beside the
        # cache (-1: its decode is timed whole, from the batch when it began)
        self.generated = -1
        self.private = 0
        self.start = self.first_token = self.finish = INF


class Replica:
    __slots__ = (
        "_acquire",
        "_chunked_prefill",
        "_decoding",
        "_left",
        "_max_running",
        "_prefill_seconds",
        "_release",
        "_step_seconds",
        "backlog",
        "block_size",
        "busy_seconds",
        "cache",
        "context_tokens",
        "done",
        "due",
        "index",
        "model",
        "preemptions",
        "prefill_end",
        "prefilled",
        "prefilling",
        "served",
        "waiting",
    )

    def __init__(
        self,
        index: int,
        capacity_blocks: int | None,
        block_size: int,
        model: ServiceModel,
        done: list[Job],
        events: CacheEvents | None = None,
    ) -> None:
        self.index = index
        self.cache = PrefixCache(capacity_blocks, events)
        self.block_size = block_size
        self.model = model
        self.done = done  # finished jobs go here
        # FIFO; a job that left while waiting stays in it, marked by its start, until it comes
        # to the front (removing it at once cost a scan of the line: a crowd of clients leaving
        # a long line took time quadratic in its length, and the server stalled for it)
        self.waiting: deque[Job] = deque()
        self._left = 0  # jobs in ``waiting`` that left it
        self.prefilling: Job | None = None
        self.prefill_end = INF
        self.due = INF  # no event before this time: advance() has nothing to do until then
        self._decoding: list[tuple[float, int, Job]] = []  # a heap by finish time
        self.backlog = 0.0  # the prefill seconds the waiting jobs were expected to take
        self.context_tokens = 0  # prompt + output tokens of the running jobs
        self.served = 0
        self.preemptions = 0  # running requests sent back to wait (only when bound by memory)
        self.busy_seconds = 0.0  # prefill seconds
        # Jobs whose first token came, for a caller that must act on it (the real-time server
        # streams from then on); offline nothing needs it, so None.
        self.prefilled: list[Job] | None = None
        # What the event loop calls per request, looked up once here (the model is frozen and the
        # cache never replaced)
        self._max_running = model.max_running
        self._chunked_prefill = model.chunked_prefill
        self._prefill_seconds = model.prefill.remaining_work_function()
        self._step_seconds = model.decode.step_seconds
        self._acquire, self._release = self.cache.acquire, self.cache.release

    @property
    def running(self) -> int:
        return len(self._decoding) + (self.prefilling is not None)

    @property
    def queued(self) -> int:
        """Requests waiting for their prefill to start."""
        return len(self.waiting) - self._left

    @property
    def outstanding(self) -> int:
        """Requests routed here and not finished: waiting and running."""
        return self.queued + self.running

    def expected_wait(self, now: float) -> float:
        """Seconds until a request routed here now would start its prefill, as a router can know
        it: the rest of the current prefill and the expected prefills of those waiting."""
        return (self.prefill_end - now if self.prefilling is not None else 0.0) + self.backlog

    def prefill_seconds(self, job: Job, cached_blocks: int) -> float:
        return self._prefill_seconds(job.prompt_tokens, cached_blocks * self.block_size)

    def enqueue(self, job: Job, now: float) -> None:
        job.replica = self.index
        self.waiting.append(job)
        self.backlog += job.estimate
        if self.prefilling is None:  # else it waits for the prefill lane (skip the call)
            self._start(now)

    def advance(self, until: float) -> None:
        """Play this replica's events up to ``until``: prefills ending, requests finishing, and
        the waiting ones starting as room frees. A replay runs this for every request, so the
        first token's event is played here rather than in a method of its own."""
        decoding, release, done = self._decoding, self._release, self.done
        while True:
            prefill_end = self.prefill_end
            if decoding:
                finish = decoding[0][0]
                if finish <= prefill_end:
                    if finish > until:
                        self.due = finish
                        return
                    finished = heappop(decoding)[2]
                    finished.finish = finish  # later than planned when prefills paused its decode
                    release(finished.blocks, finished.held)
                    self.context_tokens -= finished.prompt_tokens + finished.output_tokens
                    done.append(finished)
                    if self.prefilling is None and self.waiting:  # else nobody can start: skip the call
                        self._start(finish)
                    continue
            job = self.prefilling
            if job is None or prefill_end > until:  # None: no prefill (its end is INF), no decode
                self.due = prefill_end
                return
            # the prefill ends: its first token, then the decode at the batch it joins
            job.first_token = prefill_end
            if self.prefilled is not None:
                self.prefilled.append(job)
            self.prefilling = None
            self.prefill_end = INF
            steps = job.output_tokens - 1  # the first token came with prefill
            if steps > 0:
                batch = len(decoding) + 1
                finish = prefill_end + steps * self._step_seconds(batch, self.context_tokens / batch)
            else:
                finish = prefill_end
            job.finish = finish
            heappush(decoding, (finish, job.order, job))
            self.served += 1
            if self.waiting:
                self._start(prefill_end)

    def abort(self, job: Job, now: float) -> None:
        """A request leaves before it finished (its client went away), at ``now`` (the caller
        has played events up to it): waiting, it just leaves the line; decoding, it frees its
        blocks (they stay cached, evictable) and finishes now. A prefill is not cut short (its
        blocks would be cached half computed): the job finishes with its first token instead."""
        if job.finish <= now or job.replica != self.index:
            return
        if job.start == INF:
            job.start = job.first_token = job.finish = now  # marked: _start drops it from the line
            self._left += 1
            if self._left * 2 > len(self.waiting):  # mostly the departed: keep the line to its size
                self.waiting = deque(waiting for waiting in self.waiting if waiting.start == INF)
                self._left = 0
            self.backlog = max(self.backlog - job.estimate, 0.0) if self.queued else 0.0
            self.done.append(job)
            return
        if job is self.prefilling:
            self.context_tokens -= job.output_tokens - 1
            job.output_tokens = 1  # advance then schedules its end with its first token
            return
        entry = next((e for e in self._decoding if e[2] is job), None)
        if entry is None:
            return
        self._decoding.remove(entry)
        heapify(self._decoding)
        job.finish = now
        self.cache.release(job.blocks, job.held)
        self.context_tokens -= job.prompt_tokens + job.output_tokens
        self.done.append(job)
        self._start(now)
        self.due = min(self.due, self._decoding[0][0] if self._decoding else INF, self.prefill_end)

    def _start(self, now: float) -> None:
        waiting = self.waiting
        # An empty line first: most calls find it so (``_left`` never exceeds the line's length)
        if not waiting or self.prefilling is not None or len(self._decoding) >= self._max_running:
            return
        left = self._left
        if left:
            if len(waiting) == left:
                waiting.clear()  # whoever is left in it has departed
                self._left = 0
                return
            while waiting[0].start != INF:  # left while waiting
                waiting.popleft()
                left -= 1
            self._left = left
        job = waiting.popleft()
        self.backlog = self.backlog - job.estimate if len(waiting) > left else 0.0
        reused, job.held = self._acquire(job.blocks, job.limit, job.scope)
        cached = job.cached_tokens = reused * self.block_size
        job.start = now
        duration = self._prefill_seconds(job.prompt_tokens, cached)
        self.busy_seconds += duration
        self.prefilling = job
        end = self.prefill_end = now + duration
        if end < self.due:
            self.due = end
        self.context_tokens += job.prompt_tokens + job.output_tokens
        if not self._chunked_prefill and self._decoding:  # the prefill pauses every decode
            self._decoding[:] = [(finish + duration, order, j) for finish, order, j in self._decoding]
