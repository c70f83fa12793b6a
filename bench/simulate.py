"""``kvlens simulate`` on the whole Mooncake synthetic trace, beside a baseline in the same run.

    .venv/bin/python bench/simulate.py [--scales 1,10,100]

Figures (medians of CPU seconds, the process's own: these machines are shared and noisy, and
wall time counts the others' turns; read the ratios):
- the baseline: a naive ``OrderedDict`` LRU walking every block of the trace on one cache of the
  fleet's capacity, no queues, no pinning, nothing else;
- each policy on 4 replicas of 1,000 blocks, the whole replay (queues, prefill and decode,
  reduction of the finished records), in blocks per second and as a multiple of the baseline's
  time. Goals: round_robin within 2x of the walk; prefix-aware policies, which consult every
  replica's cache, within 2N = 8x. The replay is timed as :func:`simulate` runs it, without the
  loss funnel: ``kvlens simulate`` also feeds each policy's KV events to a fleet index for its
  funnel (when the ``kv-events`` extra is installed), a second analysis of every block beside
  the replay, so it has a line of its own (round_robin with the funnel) and no goal;
- the trace repeated 1x, 10x, 100x (each copy later in time and with its own blocks, streamed,
  never held in memory): seconds, blocks per second and peak RSS, so the cost is seen to be
  linear in blocks and the memory bounded; and beside it the naive walk of the same streamed
  blocks and the stream alone (making the copies' requests costs both the same), so the ratio at
  each scale is (replay - stream) / (walk - stream): each of the three in a fresh process, the
  median over ``--scaled-rounds`` rounds (default 3).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvlens.simulate.policies import POLICIES
from kvlens.simulate.run import Fleet, simulate
from kvlens.simulate.trace import BUNDLED, TraceRequest, open_trace

REPLICAS = 4
CAPACITY = 1000


def repeated(requests: list[TraceRequest], times: int) -> Iterator[TraceRequest]:
    """The trace ``times`` times over: each copy after the previous one, with blocks of its own
    (integers, as a trace reader's chained keys are: a tuple's hash is not cached, and counting
    it at every lookup would weigh the map that looks up most)."""
    span = requests[-1].arrival + 1.0
    for copy in range(times):
        for r in requests:
            blocks = r.blocks if copy == 0 else tuple(hash((copy, b)) for b in r.blocks)
            yield TraceRequest(r.index + copy * len(requests), r.arrival + copy * span, r.prompt_tokens,
                               r.output_tokens, blocks)  # fmt: skip


def naive_walk(requests: list[TraceRequest], capacity: int) -> Callable[[], None]:
    ids = [block for r in requests for block in r.blocks]
    return lambda: walk_blocks([ids], capacity)


def walk_blocks(runs: Iterable[Sequence[object]], capacity: int) -> None:
    """Every block of every run through one LRU of ``capacity`` blocks."""
    lru: OrderedDict[object, None] = OrderedDict()
    for run in runs:
        for block in run:
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                if len(lru) > capacity:
                    lru.popitem(last=False)


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times)


def scaled_run(times: int, policy: str, what: str) -> None:
    """In a fresh process: ``what`` (the replay, the stream alone, or the walk) of the trace
    ``times`` times over; print its CPU seconds and, for the replay, peak RSS. Each in a process
    of its own: run in turn in one process, whichever came after the replay or the walk took
    about a twentieth longer at 100x (the heap they leave behind), which made the ratio depend on
    the order the three were run in."""
    trace = open_trace(BUNDLED)
    requests = list(trace.requests())
    blocks = sum(len(r.blocks) for r in requests) * times
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fleet = Fleet(REPLICAS, CAPACITY, trace.block_size)
    runs: dict[str, Callable[[int], object]] = {
        "replay": lambda n: simulate(repeated(requests, n), fleet, policy),
        "stream": lambda n: deque(repeated(requests, n), maxlen=0),
        "walk": lambda n: walk_blocks((r.blocks for r in repeated(requests, n)), REPLICAS * CAPACITY),
    }
    runs[what](1)  # warm: a process's first run pays for first calls (most of a 1x run's time)
    seconds = median_seconds(lambda: runs[what](times), 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grew = (peak - before) / 1024
    print(json.dumps({"seconds": seconds, "blocks": blocks, "rss_mib": peak / 1024, "grew_mib": grew}))


def scaled(times: int, policy: str, rounds: int) -> dict[str, float]:
    """``rounds`` rounds of the replay, the stream and the walk, each in a fresh process: their
    median seconds, the replay's peak RSS, and the median of the rounds' ratios
    (replay - stream) / (walk - stream)."""
    figures: dict[str, list[float]] = {"replay": [], "stream": [], "walk": [], "ratio": []}
    replay: dict[str, float] = {}
    for _ in range(rounds):
        for what in ("replay", "stream", "walk"):
            command = [sys.executable, __file__, "--scaled-run", str(times), policy, what]
            out = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            figures[what].append(out["seconds"])
            if what == "replay":
                replay = out
        stream = figures["stream"][-1]
        figures["ratio"].append((figures["replay"][-1] - stream) / (figures["walk"][-1] - stream))
    return {name: statistics.median(values) for name, values in figures.items()} | {
        "blocks": replay["blocks"],
        "rss_mib": replay["rss_mib"],
        "grew_mib": replay["grew_mib"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scales", default="1,10,100")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scaled-rounds", type=int, default=3, help="rounds of each scaled run (medians)")
    parser.add_argument("--scaled-run", nargs=3, metavar=("TIMES", "POLICY", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scaled_run:
        scaled_run(int(args.scaled_run[0]), args.scaled_run[1], args.scaled_run[2])
        return

    trace = open_trace(BUNDLED)
    requests = list(trace.requests())
    full_blocks = sum(len(r.blocks) for r in requests)
    print(f"trace: {len(requests):,} requests, {full_blocks:,} full blocks of {trace.block_size} tokens")
    walk = naive_walk(requests, REPLICAS * CAPACITY)
    baseline = median_seconds(walk, args.repeats)
    print(f"baseline  naive OrderedDict LRU walk       {full_blocks / baseline:>12,.0f} blocks/s")
    fleet = Fleet(REPLICAS, CAPACITY, trace.block_size)
    for policy in POLICIES:
        # Turns with the baseline, so both see the same machine state; the ratio is per turn.
        ratios, seconds = [], []
        for _ in range(args.repeats):
            base = median_seconds(walk, 1)
            took = median_seconds(lambda: simulate(requests, fleet, policy), 1)  # noqa: B023
            ratios.append(took / base)
            seconds.append(took)
        goal = {"round_robin": " (goal <= 2x)", "prefix_affinity": f" (goal <= {2 * REPLICAS}x)"}
        goal["cost_aware"] = goal["prefix_affinity"]
        print_policy(policy, full_blocks, seconds, ratios, goal.get(policy, ""))
    print("scaling (round_robin, streamed, a fresh process each):")
    for times in (int(s) for s in args.scales.split(",")):
        figures = scaled(times, "round_robin", args.scaled_rounds)
        stream, ratio = figures["stream"], figures["ratio"]
        print(
            f"  {times:>4}x  {figures['blocks']:>12,} blocks  {figures['replay']:>7.2f} s  "
            f"{figures['blocks'] / figures['replay']:>12,.0f} blocks/s  "
            f"peak RSS {figures['rss_mib']:.0f} MiB (+{figures['grew_mib']:.0f} MiB while simulating); "
            f"walk {figures['walk']:.2f} s, stream {stream:.2f} s: {ratio:.2f}x the walk's time "
            f"(median of {args.scaled_rounds} rounds; goal <= 2x)"
        )
    from kvlens.fleet.index import compiled_loops_available

    # The funnel, as kvlens simulate runs it with the extra; last, as the index and its compiled
    # loops grow this process, and a scaled run's peak RSS counts its parent's at the fork.
    if compiled_loops_available():
        ratios, seconds = [], []
        for _ in range(args.repeats):
            base = median_seconds(walk, 1)
            took = median_seconds(lambda: with_funnel(requests, fleet, trace.block_size), 1)
            ratios.append(took / base)
            seconds.append(took)
        print_policy("rr + funnel", full_blocks, seconds, ratios, " (no goal: a second analysis)")


def print_policy(name: str, blocks: int, seconds: list[float], ratios: list[float], goal: str) -> None:
    rate = blocks / statistics.median(seconds)
    print(
        f"{name:<16} {REPLICAS} replicas x {CAPACITY:,}      {rate:>12,.0f} "
        f"blocks/s  = {statistics.median(ratios):.1f}x the walk's time{goal}"
    )


def with_funnel(requests: list[TraceRequest], fleet: Fleet, block_size: int) -> None:
    from kvlens.fleet.index import FleetIndex  # here: the scaled runs' RSS is the replay's alone
    from kvlens.simulate.funnel import events_into, funnel

    index = FleetIndex(hashes_alike=True)
    outcome = simulate(requests, fleet, "round_robin", events=events_into(index, block_size))
    funnel(outcome, index, fleet.service.prefill)


if __name__ == "__main__":
    main()
