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

``--worst-case`` instead runs a real ``kvlens serve --kv-events`` (the caps from the environment,
else the defaults) against one publisher on 127.0.0.1 sending the adversarial pattern: distinct
blocks to ``--fill`` (default 1.2 x the held cap), AllBlocksCleared, as many more, AllBlocksCleared,
then ``--restore`` hashes stored twice into each of the 4 tiers with no removal in between, and a
last AllBlocksCleared. After each phase it prints the process's RSS and peak (VmHWM), the index
memory gauge, the blocks held and untracked; during each clear a thread scrapes ``/metrics``
back to back, and the longest scrape is printed beside the clear's duration. Run it with
``PYTHONPATH`` pointing at another checkout for a baseline.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvlens.exporter.collector import kv_families
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.limits import MAX_HELD_BLOCKS, TIERS
from kvlens.fleet.ordering import Consumer, Publisher
from kvlens.fleet.publisher import EventPublisher
from kvlens.fleet.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch
from kvlens.fleet.simulated import SimulatedEngine
from kvlens.fleet.subscriber import KVEvents
from kvlens.fleet.wire import apply, decode_batch
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
            return kv_families(kv)

    registry = CollectorRegistry()
    registry.register(Families())
    return timed(lambda: generate_latest(registry), 5)


WORST_BATCH = 4096  # blocks a BlockStored: a payload well under the compiled reader's 1 MiB


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


class _Scraper:
    """/metrics back to back on a thread: each scrape's duration, and the latest samples."""

    def __init__(self, url: str) -> None:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        self._get = lambda: httpx.get(f"{url}/metrics", timeout=60).text
        self._parse = text_string_to_metric_families
        self.longest = 0.0
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def value(self, name: str) -> float:
        return sum(s.value for f in self._parse(self._get()) for s in f.samples if s.name == name)

    def start(self) -> None:
        self.longest, self.scrapes = 0.0, 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            self._get()
            self.longest = max(self.longest, time.perf_counter() - began)
            self.scrapes += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def worst_case(fill: int, restore: int) -> None:
    """See the module's docstring."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import json

    from tests.live import free_port, start_kvlens

    port = free_port()
    publisher = EventPublisher(f"tcp://127.0.0.1:{port}", buffer_steps=1)
    env = {"KVLENS_KV_EVENTS": json.dumps([{"name": "r0", "endpoint": publisher.endpoint}])}
    sidecar = start_kvlens("serve", env=env, start_seconds=120)
    scraper = _Scraper(sidecar.url)
    pid = sidecar.process.pid
    sent = 0
    next_hash = 1 << 20

    def send(events: list[Event]) -> None:
        nonlocal sent
        publisher.publish_events(events)
        sent += 1
        if sent % 64 == 0:  # paced: kvlens never more than 64 messages behind (no drops)
            while scraper.value("kvlens_kv_event_batches_total") < sent - 64:
                time.sleep(0.05)

    def settle() -> None:
        while scraper.value("kvlens_kv_event_batches_total") < sent:
            time.sleep(0.05)

    def stored(first: int, count: int, medium: str) -> None:
        for start in range(first, first + count, WORST_BATCH):
            hashes = list(range(start, min(start + WORST_BATCH, first + count)))
            send([BlockStored(hashes, None, hashes, 1, None, medium, None)])

    def report(phase: str) -> None:
        settle()
        print(
            f"{phase}: RSS {_status_mib(pid, 'VmRSS'):,.0f} MiB, "
            f"peak (VmHWM) {_status_mib(pid, 'VmHWM'):,.0f} MiB, "
            f"kvlens_kv_index_memory_bytes {scraper.value('kvlens_kv_index_memory_bytes') / 2**20:,.0f} MiB, "
            f"blocks held {scraper.value('kvlens_kv_blocks_held'):,.0f}, "
            f"untracked {scraper.value('kvlens_kv_untracked_blocks_total'):,.0f}, "
            f"remembered {scraper.value('kvlens_kv_remembered_blocks'):,.0f}",
            flush=True,
        )

    def clear(phase: str) -> None:
        settle()
        removed = scraper.value("kvlens_kv_blocks_removed_total") + scraper.value("kvlens_kv_blocks_held")
        scraper.start()  # the baseline: scrapes with nothing to do, on this machine now
        time.sleep(3)
        scraper.stop()
        idle = scraper.longest
        scraper.start()
        began = time.perf_counter()
        send([AllBlocksCleared()])
        while scraper.value("kvlens_kv_blocks_removed_total") < removed:
            time.sleep(0.01)
        took = time.perf_counter() - began
        scraper.stop()
        print(
            f"  {phase}: the clear took {took:.2f} s; {scraper.scrapes} scrapes meanwhile, "
            f"the longest {scraper.longest * 1e3:,.0f} ms (idle just before: {idle * 1e3:,.0f} ms)",
            flush=True,
        )
        report(phase)

    try:
        publisher.wait_subscribed(60)
        print(f"kvlens serve --kv-events (pid {pid}), caps from the environment or the defaults", flush=True)
        report("started")
        for round_ in (1, 2):
            stored(next_hash, fill, "GPU")
            next_hash += fill
            report(f"filled {fill:,} distinct blocks ({round_})")
            clear(f"cleared ({round_})")
        for tier in TIERS:
            for _ in range(2):
                stored(next_hash, restore, tier)
        report(f"{restore:,} hashes stored twice in each of {len(TIERS)} tiers")
        clear("cleared (3)")
    finally:
        publisher.close()
        sidecar.output()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=5000, help="trace blocks per replica")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--held", type=int, default=1_000_000, help="blocks held for the memory figure")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (each case just after a bare decode)")
    parser.add_argument("--worst-case", action="store_true", help="the memory worst case of kvlens serve")
    parser.add_argument("--fill", type=int, default=MAX_HELD_BLOCKS * 6 // 5, help="distinct blocks a fill")
    parser.add_argument("--restore", type=int, default=2_000_000, help="hashes re-stored across the tiers")
    args = parser.parse_args()
    if args.worst_case:
        worst_case(args.fill, args.restore)
        return

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
