"""KV events into the fleet index at full speed, beside a bare msgspec decode of the same messages.

    .venv/bin/python bench/kv_events.py [--replicas 4] [--capacity 20000] [--block-tokens 16]

The messages: the bundled Mooncake trace replayed by the simulator on a fleet under round robin,
its caches publishing vLLM-format events, each trace block announced as a block of
``--block-tokens`` tokens (vLLM's default is 16), in two framings:
- ``one event a batch``: one ``EventBatch`` per store or eviction, the worst case for the
  per-message cost (the goal is judged on it);
- ``a request a batch``: the consecutive events of one replica (a request's stores and the
  evictions they caused) in one ``EventBatch``; vLLM sends one batch per engine step with the
  events of every request in it, so real batches are this size or larger.

Figures (medians of ``--repeat`` interleaved rounds; these machines are noisy, so read the
ratios: each round times every case just after a bare decode of the same messages, and a
case's share of the bare decode's rate is the median of its rounds' ratios (bare decode's time
over the case's), with their spread; CPU seconds are the process's, all threads):
- the baseline: ``msgspec.msgpack.Decoder(KVEventBatch)`` over every payload, the vLLM structs
  typed (what any consumer must at least do): blocks per second;
- kvlens: the consumer (sequence check, decode, classification, holding) over the same payloads,
  by content key and with ``hashes_alike``: blocks per second, and as a share of the baseline's
  rate; then the msgspec event-by-event path alone (``decode_batch`` + ``apply``, no consumer:
  what a payload the compiled reader leaves costs). Goals: >= 200k blocks/s on one core, >= a
  third of the bare decode;
- memory: bytes per held (block, replica) and per remembered block, measured with tracemalloc
  on an index of ``--held`` blocks, and the process's RSS growth per million blocks held (goal:
  <= 48 bytes each);
- ``/metrics``: rendering the KV families of that index (goal: < 50 ms).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvlens.exporter.collector import _kv_families
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.simulated import SimulatedEngine
from kvlens.fleet.source import Consumer, KVEvents, Publisher
from kvlens.fleet.wire import BlockRemoved, BlockStored, Event, KVEventBatch, apply, decode_batch
from kvlens.simulate.run import Fleet, simulate
from kvlens.simulate.trace import BUNDLED, MOONCAKE, Trace

Message = tuple[str, int, bytes]


def messages(replicas: int, capacity: int, block_tokens: int, per_request: bool) -> tuple[list[Message], int]:
    encode = msgspec.msgpack.Encoder().encode
    out: list[Message] = []
    seqs = dict.fromkeys((f"r{i}" for i in range(replicas)), 0)
    blocks = 0
    pending: list[Event] = []
    pending_replica = ""

    def flush() -> None:
        if pending:
            payload = encode(KVEventBatch(ts=time.time(), events=list(pending), data_parallel_rank=0))
            out.append((pending_replica, seqs[pending_replica], payload))
            seqs[pending_replica] += 1
            pending.clear()

    def emit(replica: str, event: Event) -> None:
        nonlocal blocks, pending_replica
        assert isinstance(event, (BlockStored, BlockRemoved))
        blocks += len(event.block_hashes)
        if not per_request or replica != pending_replica:
            flush()
        pending_replica = replica
        pending.append(event)

    engines = [SimulatedEngine(f"r{i}", block_tokens, emit) for i in range(replicas)]
    requests = list(Trace(str(BUNDLED), MOONCAKE, 512).requests())
    simulate(requests, Fleet(replicas, capacity, 512), "round_robin", events=lambda i: engines[i])
    flush()
    return out, blocks


Figures = dict[str, tuple[float, float, list[tuple[float, float]]]]


def _shares(ratios: list[tuple[float, float]]) -> str:
    wall, cpu = [r for r, _ in ratios], [r for _, r in ratios]
    return (
        f"{statistics.median(wall):.2f} of the bare decode's rate (median of {len(ratios)} rounds' ratios;"
        f" {min(wall):.2f}-{max(wall):.2f}; by CPU seconds {statistics.median(cpu):.2f},"
        f" {min(cpu):.2f}-{max(cpu):.2f})"
    )


def _clocked(run: Callable[[], None]) -> tuple[float, float]:
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - start, time.process_time() - cpu


def interleaved(baseline: str, cases: dict[str, Callable[[], None]], repeat: int) -> Figures:
    """Each case run once a round, ``repeat`` rounds, each run just after a run of the baseline
    (``cases[baseline]``): the median (wall, CPU) seconds of each case, and each round's ratio of
    the baseline's time to the case's (wall, CPU). The pair runs back to back on the same messages, so a
    ratio compares runs made under the same load: the bare decode's own time moves by half from
    one round or run to the next on a shared machine, and a ratio of medians taken apart carries
    that."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, run in cases.items():
            if name == baseline:
                continue
            base = _clocked(cases[baseline])
            times[baseline].append(base)
            took = _clocked(run)
            times[name].append(took)
            ratios[name].append((base[0] / took[0], base[1] / took[1]))
    return {
        name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs), ratios[name])
        for name, runs in times.items()
    }


def timed(run: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bare_decode(payloads: list[Message]) -> Callable[[], None]:
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode

    def run() -> None:
        for _, _, payload in payloads:
            decode(payload)

    return run


def kvlens(payloads: list[Message], replicas: int, alike: bool) -> Callable[[], None]:
    def run() -> None:
        consumer = Consumer(
            FleetIndex(hashes_alike=alike), [Publisher(f"r{i}", "tcp://x:1") for i in range(replicas)]
        )
        message = consumer.message
        for replica, seq, payload in payloads:
            message(replica, seq, payload, None)

    return run


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def index_only(payloads: list[Message], replicas: int, alike: bool) -> Callable[[], None]:
    """The msgspec path (every payload the compiled reader leaves to it takes this one), without
    the consumer's sequence check and ordering."""

    def run() -> None:
        index = FleetIndex(hashes_alike=alike)
        for replica, _, payload in payloads:
            for event in decode_batch(payload).events:
                apply(index, replica, event)

    return run


def memory(held: int, block_tokens: int, alike: bool) -> tuple[float, float, float, FleetIndex]:
    """Bytes per held (block, replica) entry, everything the index keeps for it (tracemalloc, and
    the process's RSS growth), and per remembered block (the same blocks, removed)."""
    chains = held // 64
    gc.collect()
    before = rss()
    tracemalloc.start()
    index = FleetIndex(hashes_alike=alike, remember_blocks=held, max_held_blocks=held)
    base = tracemalloc.get_traced_memory()[0]
    for chain in range(chains):  # 64-block prompts, each its own tokens
        first = chain * 64
        tokens = np.arange(first * block_tokens, (first + 64) * block_tokens, dtype=np.uint64)
        index.stored("r0", list(range(first, first + 64)), None, tokens, block_tokens)
    holding = tracemalloc.get_traced_memory()[0] - base
    grown = rss() - before
    for chain in range(chains):
        index.removed("r0", list(range(chain * 64, chain * 64 + 64)))
    remembering = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert index.snapshot().remembered_blocks == chains * 64
    return holding / (chains * 64), grown / (chains * 64), remembering / (chains * 64), index


def render_seconds(index: FleetIndex, replicas: int) -> float:
    kv = KVEvents([Publisher(f"r{i}", "tcp://x:1") for i in range(replicas)], index)

    class Families(Collector):
        def collect(self) -> list[Metric]:
            return _kv_families(kv)

    registry = CollectorRegistry()
    registry.register(Families())
    return timed(lambda: generate_latest(registry), 5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=5000, help="trace blocks per replica")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--held", type=int, default=1_000_000, help="blocks held for the memory figure")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (each case just after a bare decode)")
    args = parser.parse_args()

    FleetIndex()  # numba's loops loaded (or compiled) once, before any round is timed
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for framing, per_request in (("one event a batch", False), ("a request a batch", True)):
        payloads, blocks = messages(args.replicas, args.capacity, args.block_tokens, per_request)
        size = sum(len(p) for _, _, p in payloads)
        print(f"\n{framing}: {len(payloads):,} messages, {blocks:,} blocks, {size / 1e6:.1f} MB of payload")
        bare = "bare msgspec decode (typed KVEventBatch)"
        cases = {bare: bare_decode(payloads)}
        for alike in (False, True):
            label = "engine hash as key (hashes_alike)" if alike else "content keys"
            cases[f"kvlens consumer, {label}"] = kvlens(payloads, args.replicas, alike)
            cases[f"  msgspec event-by-event path, {label}"] = index_only(payloads, args.replicas, alike)
        figures = interleaved(bare, cases, args.repeat)
        for name, (wall, cpu, ratios) in figures.items():
            share = "" if name == bare else ", " + _shares(ratios)
            print(f"{name}: {blocks / wall:,.0f} blocks/s ({wall:.3f} s wall, {cpu:.3f} s CPU){share}")
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    for alike in (False, True):
        held, grown, remembered, index = memory(args.held, args.block_tokens, alike)
        label = "hashes_alike" if alike else "content keys"
        print(
            f"memory ({label}): {held:.1f} bytes per held block (RSS {grown:.1f} MB per million held), "
            f"{remembered:.1f} per remembered block"
        )
    print(f"/metrics render of the KV families: {render_seconds(index, args.replicas) * 1e3:.2f} ms")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
