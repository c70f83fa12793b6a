"""Replay a trace on a fleet under a routing policy, and walk it through one cache to find the
reuse the workload could reach.

Finished requests become kvlens records (a :class:`~kvlens.records.RecordBatch` per chunk) and
go through :func:`kvlens.reduce.reduce`, the step every consumer uses, so a simulated hit ratio,
token reuse or compute saved is the same number the sidecar and ``analyze`` would give for those
records. The trace is streamed: memory holds the caches, the requests in flight, one chunk of
finished records and 8 bytes per request for exact latency percentiles.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import orjson

from kvlens.definitions import Totals, safe_ratio
from kvlens.records import RecordBatch
from kvlens.reduce import reduce
from kvlens.simulate.cache import CacheEvents, PrefixCache, hit_limit
from kvlens.simulate.memory import make_replica
from kvlens.simulate.policies import DEFAULT_GUARD, Choose, Guard, policy
from kvlens.simulate.replica import DEFAULT_SERVICE, INF, Job, Replica, ServiceModel
from kvlens.simulate.trace import TraceRequest
from kvlens.stats import percentiles

CHUNK = 16_384  # finished requests reduced at a time
MODEL = "simulated"
UNBOUNDED = "unbounded"


def parse_capacity(text: str) -> int | None:
    """A ``--capacity-blocks`` value: blocks per replica, or ``unbounded`` (None). Raises
    ValueError on anything else; each command says what it takes (a count, or a list)."""
    text = text.strip()
    return None if text == UNBOUNDED else int(text)


@dataclass(frozen=True)
class Fleet:
    replicas: int
    capacity_blocks: int | None  # per replica; None: unbounded
    block_size: int
    service: ServiceModel = DEFAULT_SERVICE
    guard: Guard | None = DEFAULT_GUARD

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("a fleet needs one replica or more")

    def build(
        self, policy_name: str, done: list[Job], events: Callable[[int], CacheEvents] | None = None
    ) -> tuple[list[Replica], Choose]:
        """The replicas (each with its cache, bound by its memory when the service model says so)
        and the routing policy, made here for both clocks: :func:`simulate` steps them through a
        trace, ``simulate serve``'s :class:`~kvlens.simulate.serve.engine.RealTimeFleet` on the wall
        clock, so a request's route, cached tokens and timings are the same on both. Finished jobs
        go to ``done``; ``events(i)``, when given, is told what replica i's cache stores and
        evicts."""
        choose = policy(policy_name, self.guard)  # an unknown name fails before anything is built
        replicas = [
            make_replica(
                i,
                self.capacity_blocks,
                self.block_size,
                self.service,
                done,
                None if events is None else events(i),
            )
            for i in range(self.replicas)
        ]
        return replicas, choose


@dataclass
class Outcome:
    """What one policy (or one walk) delivered on the trace."""

    name: str
    capacity_blocks: int | None
    totals: Totals = field(default_factory=Totals)
    ttft: list[npt.NDArray[np.float32]] = field(default_factory=list)
    queue: list[npt.NDArray[np.float32]] = field(default_factory=list)
    requests_per_replica: list[int] = field(default_factory=list)
    prefill_seconds_per_replica: list[float] = field(default_factory=list)
    evictions: int = 0
    refused: int = 0  # blocks left uncached for lack of room (not in the summary)

    def add(self, batch: RecordBatch, service: ServiceModel) -> None:
        reduced = reduce(batch, edges=[], cost_for=lambda _: service.prefill, default_model=MODEL)
        self.totals = self.totals + reduced.totals()
        if not np.isnan(batch.ttft_seconds).all():
            self.ttft.append(batch.ttft_seconds.astype(np.float32))
            self.queue.append(batch.queue_seconds.astype(np.float32))

    def summary(self) -> dict[str, Any]:
        totals = self.totals
        out: dict[str, Any] = {
            "policy": self.name,
            "capacity_blocks": self.capacity_blocks,
            "requests": totals.requests,
            "request_hit_ratio": totals.request_hit_ratio,
            "token_reuse_ratio": totals.token_reuse_ratio,
            "compute_saved_ratio": totals.compute_saved_ratio,
            "evictions": self.evictions,
        }
        if self.ttft:
            ttft = np.concatenate(self.ttft).astype(np.float64)
            queue = np.concatenate(self.queue).astype(np.float64)
            served = self.requests_per_replica
            out |= {
                "ttft_seconds": percentiles(ttft),
                "queue_seconds": percentiles(queue),
                "queue_share_of_ttft": safe_ratio(float(queue.sum()), float(ttft.sum())),
                "requests_per_replica": served,
                "prefill_seconds_per_replica": self.prefill_seconds_per_replica,
                "load_imbalance": max(served) / (sum(served) / len(served)) if sum(served) else None,
            }
        return out


def simulate(
    requests: Iterable[TraceRequest],
    fleet: Fleet,
    policy_name: str,
    *,
    records: Callable[[list[dict[str, Any]]], None] | None = None,
    arm: str | None = None,
    progress: Callable[[int], None] | None = None,
    events: Callable[[int], CacheEvents] | None = None,
) -> Outcome:
    """Route each request at its arrival, play the replicas' queues, and reduce what finished.
    ``records`` is handed the finished requests as kvlens records, in arrival order, their
    ``arm`` the policy's name unless given (:func:`write_records` writes them as JSON lines);
    ``progress`` is told how many more requests arrived; ``events(i)``, when given, is the sink
    of replica i's KV events (:class:`~kvlens.simulate.cache.CacheEvents`)."""
    arm = arm or policy_name
    writer = None if records is None else _InArrivalOrder(records, fleet.block_size, arm)
    done: list[Job] = []
    replicas, choose = fleet.build(policy_name, done, events)
    outcome = Outcome(policy_name, fleet.capacity_blocks)
    with _cycle_collector_paused():
        _replay(requests, replicas, choose, done, outcome, fleet, arm, writer, progress)
    outcome.requests_per_replica = [r.served for r in replicas]
    outcome.prefill_seconds_per_replica = [r.busy_seconds for r in replicas]
    outcome.evictions = sum(r.cache.evictions for r in replicas)
    outcome.refused = sum(r.cache.refused for r in replicas)
    return outcome


@contextmanager
def _cycle_collector_paused() -> Iterator[None]:
    """A replay allocates objects a request (its job, its hold, its queue entries) and makes no
    reference cycle (tested), so Python's cyclic collector only walks the process's long-lived
    objects again and again while it runs: a tenth of a replay ten times the bundled trace. It is
    paused for the replay, and set back as it was (the garbage of others' cycles, if a records or
    events sink makes some, is collected then)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _replay(
    requests: Iterable[TraceRequest],
    replicas: list[Replica],
    choose: Choose,
    done: list[Job],
    outcome: Outcome,
    fleet: Fleet,
    arm: str,
    writer: _InArrivalOrder | None,
    progress: Callable[[int], None] | None,
) -> None:
    order = 0
    block_size = fleet.block_size
    new_job, chunk = Job, CHUNK  # locals: this loop runs once a request
    for request in requests:
        now = request.arrival
        for replica in replicas:
            if replica.due <= now:
                replica.advance(now)
        job = new_job(request, order, block_size)
        replicas[choose(job, replicas, now)].enqueue(job, now)
        order += 1
        if len(done) >= chunk:
            _flush(done, outcome, fleet, arm, writer)
        if progress is not None and order % 1024 == 0:
            progress(1024)
    for replica in replicas:
        replica.advance(INF)
    _flush(done, outcome, fleet, arm, writer)
    if progress is not None:
        progress(order % 1024)


def walk(
    requests: Iterable[TraceRequest],
    capacity_blocks: int | None,
    block_size: int,
    name: str,
    service: ServiceModel = DEFAULT_SERVICE,
) -> Outcome:
    """The reuse of one cache of ``capacity_blocks`` that sees every request in arrival order and
    holds nothing beyond a request's own instant: unbounded, it is the reuse the workload could
    reach at all; with a fleet's whole capacity, what a perfect router would get."""
    cache = PrefixCache(capacity_blocks)
    prompt: list[int] = []
    cached: list[int] = []
    outcome = Outcome(name, capacity_blocks)
    for request, reused in served(requests, cache, block_size):
        prompt.append(request.prompt_tokens)
        cached.append(reused)
        if len(prompt) >= CHUNK:
            outcome.add(_token_batch(prompt, cached, block_size), service)
            prompt, cached = [], []
    outcome.add(_token_batch(prompt, cached, block_size), service)
    outcome.evictions = cache.evictions
    return outcome


def served(
    requests: Iterable[TraceRequest], cache: PrefixCache, block_size: int
) -> Iterator[tuple[TraceRequest, int]]:
    """Each request, in the order given, and the prompt tokens ``cache`` served it (which then
    holds its blocks as far as room allows). ``PrefixCache(None)`` gives the theoretical reuse of
    a trace: an unbounded cache that has seen every request before."""
    for request in requests:
        keys = request.keys  # salted as the engine keys them: two salts never share
        reused, held = cache.acquire(keys, hit_limit(request.prompt_tokens, block_size))
        cache.release(keys, held)
        yield request, reused * block_size


def _flush(done: list[Job], outcome: Outcome, fleet: Fleet, arm: str, writer: _InArrivalOrder | None) -> None:
    if not done:
        return
    outcome.add(_job_batch(done, fleet.block_size, arm), fleet.service)
    if writer is not None:
        writer.finished(done)
    done.clear()


class _InArrivalOrder:
    """Hands finished requests on as records in arrival order (as ``compare`` pairs arms position
    by position), holding back only those that finished before an earlier arrival did."""

    def __init__(self, sink: Callable[[list[dict[str, Any]]], None], block_size: int, arm: str) -> None:
        self.sink, self.block_size, self.arm = sink, block_size, arm
        self.waiting: list[tuple[int, Job]] = []
        self.next = 0

    def finished(self, jobs: list[Job]) -> None:
        for job in jobs:
            heapq.heappush(self.waiting, (job.order, job))
        ready = []
        while self.waiting and self.waiting[0][0] == self.next:
            ready.append(heapq.heappop(self.waiting)[1])
            self.next += 1
        if ready:
            self.sink([record(job, self.block_size, self.arm) for job in ready])


def _token_batch(prompt: list[int], cached: list[int], block_size: int) -> RecordBatch:
    return _batch(len(prompt), block_size, np.array(prompt, np.int64), np.array(cached, np.int64))


def _job_batch(jobs: list[Job], block_size: int, arm: str) -> RecordBatch:
    count = len(jobs)
    # A list of each attribute, then its array: numpy pulling every value through an
    # attrgetter took half again as long (a tenth of a replay's time outside its caches)
    arrival = np.fromiter([job.arrival for job in jobs], np.float64, count)
    start = np.fromiter([job.start for job in jobs], np.float64, count)
    first = np.fromiter([job.first_token for job in jobs], np.float64, count)
    return _batch(
        count,
        block_size,
        np.fromiter([job.prompt_tokens for job in jobs], np.int64, count),
        np.fromiter([job.cached_tokens for job in jobs], np.int64, count),
        queue_seconds=start - arrival,
        prefill_seconds=first - start,
        ttft_seconds=first - arrival,
        arm=[arm] * count,
    )


def _batch(
    count: int,
    block_size: int,
    prompt_tokens: npt.NDArray[np.int64],
    cached_tokens: npt.NDArray[np.int64],
    **measured: Any,
) -> RecordBatch:
    """``count`` simulated requests as :meth:`Outcome.add` reduces them: their tokens and the
    ``measured`` columns; every other column absent (the reduction and the latency percentiles
    do not read them; the records carry them)."""
    absent = np.full(count, np.nan)
    columns: dict[str, Any] = {
        "queue_seconds": absent,
        "prefill_seconds": absent,
        "ttft_seconds": absent,
        "decode_seconds": absent,
        "e2e_seconds": absent,
        "arrival_time": absent,
        "arm": [None] * count,
    }
    columns.update(measured)
    return RecordBatch(
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=np.full(count, -1, np.int64),
        block_size=np.full(count, block_size, np.int64),
        model_codes=np.zeros(count, np.int32),
        model_names=[MODEL],
        replica=[None] * count,
        request_id=[None] * count,
        tenant=[None] * count,
        finish_reason=[None] * count,
        session_id=[None] * count,
        trace_reusable_tokens=np.full(count, -1, np.int64),
        prefix_hashes=[None] * count,
        **columns,
    )


def record(job: Job, block_size: int, arm: str) -> dict[str, Any]:
    """A finished request as a kvlens record that ``analyze``, ``compare`` and the sidecar read."""
    return {
        "request_id": str(job.index),
        "model": MODEL,
        "arm": arm,
        "replica": f"r{job.replica}",
        "prompt_tokens": job.prompt_tokens,
        "cached_tokens": job.cached_tokens,
        "output_tokens": job.output_tokens,
        "queue_seconds": job.start - job.arrival,
        "prefill_seconds": job.first_token - job.start,
        "ttft_seconds": job.first_token - job.arrival,
        "decode_seconds": job.finish - job.first_token,
        "e2e_seconds": job.finish - job.arrival,
        "arrival_time": job.arrival,
        "block_size": block_size,
        "prefix_hashes": list(job.blocks),
    }


def write_records(out: IO[bytes]) -> Callable[[list[dict[str, Any]]], None]:
    """A ``records`` sink that writes JSON lines to ``out``."""

    def write(records: list[dict[str, Any]]) -> None:
        out.writelines(orjson.dumps(r) + b"\n" for r in records)

    return write
