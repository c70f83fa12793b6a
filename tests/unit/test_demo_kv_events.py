"""``kvlens demo``'s "Why reuse is lost": the replay's cache events reach the sidecar's index
through the KV events consumer in process, with the causes the simulated engines give when they
feed an index directly, and each loop of the trace repeats the first loop's causes."""

from __future__ import annotations

from collections import Counter

from kvlens.cli.demo import causes_summary, in_process_kv_events
from kvlens.config import load_settings
from kvlens.definitions import CostModel
from kvlens.fleet.index import FleetIndex
from kvlens.fleet.simulated import SimulatedEngine, into_index
from kvlens.simulate.demo import ReplayKVEvents, ReplayTraffic

WINDOW = 200.0  # trace seconds of each loop fed (a fifth of the trace: the test stays fast)


def test_the_demo_feed_gives_the_simulated_engines_causes_and_each_loop_the_same() -> None:
    traffic = ReplayTraffic(speed=1.0, origin=0.0, kv_events=True)
    direct = FleetIndex()
    emit = into_index(direct)
    engines = [SimulatedEngine(f"r{i}", traffic.block_size, emit) for i in range(traffic.replicas)]
    for _, (_, replica, stored, blocks, parent) in traffic.cache_events(0.0, WINDOW):
        if stored:
            engines[replica].stored(blocks, parent)
        else:
            engines[replica].removed(blocks)
    expected = Counter(direct.recomputed_tokens)
    assert sum(expected.values()) > 0

    kv_events = in_process_kv_events(load_settings(None), ReplayKVEvents.names(traffic.replicas))
    feed = ReplayKVEvents(traffic, kv_events)
    feed.feed(0.0, WINDOW)
    before = kv_events.snapshot()
    first = Counter(before.index.recomputed_tokens)
    assert first == expected
    cost = CostModel(a=1.0, b=0.01, unit="flops")
    line = causes_summary(kv_events, cost)
    by_cause: Counter[str] = Counter()
    for (_, cause), tokens in expected.items():
        by_cause[cause] += tokens
    work: Counter[str] = Counter()  # the funnel's: each cause's modelled work, its depths known
    for (_, cause), amount in before.index.recomputed_work(cost).items():
        work[cause] += amount
    whole, whole_work = sum(by_cause.values()), sum(work.values())
    assert line.startswith("recomputed: ") and line.endswith(" (tokens | flops)")
    parts = line.removeprefix("recomputed: ").removesuffix(" (tokens | flops)").split(", ")
    shares = {part.split(" ")[0]: part.split(" ")[1:] for part in parts}

    def share(fraction: float) -> str:
        return f"{100 * fraction:.0f}" if fraction >= 0.005 else "<1"

    assert shares == {
        cause: [share(tokens / whole), "|", share(work[cause] / whole_work), "%"]
        for cause, tokens in by_cause.items()
    }
    assert next(iter(shares)) == "new"

    span = traffic.loop_seconds
    feed.feed(span, span + WINDOW)  # the second loop: cleared, new content
    after = kv_events.snapshot()
    assert Counter(after.index.recomputed_tokens) == first + first
    for name, status in after.publishers.items():  # one more batch each: AllBlocksCleared
        assert (status.up, status.batches) == (1, 2 * before.publishers[name].batches + 1)
        assert status.malformed_payloads == status.gaps == status.errors == 0
