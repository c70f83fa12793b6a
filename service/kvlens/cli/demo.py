"""``kvlens demo``: the sidecar fed live by the simulator replaying a real trace."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from typing import Any, TextIO

from kvlens import terminal
from kvlens.cli import SUMMARIES
from kvlens.cli.common import build_server, examples, server_flags, settings_from
from kvlens.config import Settings
from kvlens.definitions import DEFAULT_COST_MODEL, CostModel
from kvlens.errors import MissingExtra
from kvlens.exporter.aggregator import Aggregator
from kvlens.exporter.background import fleet_index
from kvlens.fleet.causes import CAUSES
from kvlens.fleet.index import compiled_loops_available
from kvlens.fleet.ordering import Publisher
from kvlens.fleet.subscriber import KVEvents
from kvlens.records import batch_from_objects
from kvlens.simulate import demo
from kvlens.simulate.trace import BUNDLED_AGENTIC

# The bundled conversations record no offset between them: one starts every 30 s of trace time.
AGENTIC_SESSION_RATE = 1 / 30


def add_parser(commands: Any) -> None:
    run_demo = commands.add_parser(
        "demo",
        help=SUMMARIES["demo"],
        epilog=examples(
            "kvlens demo",
            "kvlens demo --speed 10 --policy round_robin --port 9500",
            "kvlens demo --traffic synthetic --rate 50 --duration 60",
        ),
    )
    server_flags(run_demo)
    run_demo.add_argument(
        "--traffic",
        choices=("replay", "agentic", "synthetic"),
        default="replay",
        help="replay: the bundled Mooncake trace on a simulated fleet (default); agentic: eight bundled "
        "coding-assistant conversations (kv-cache-tester) on it; synthetic: article-shaped",
    )
    run_demo.add_argument("--speed", type=float, default=4.0, help="replay this many times faster")
    run_demo.add_argument(
        "--policy",
        default="prefix_affinity",
        choices=("round_robin", "least_queue", "prefix_affinity", "cost_aware"),
        metavar="POLICY",
        help="the replay fleet's router: round_robin, least_queue, prefix_affinity or cost_aware",
    )
    run_demo.add_argument("--rate", type=float, default=20.0, help="synthetic: requests per second")
    run_demo.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    run_demo.add_argument("--every", type=float, default=5.0, help="seconds between summary lines")
    run_demo.add_argument("--duration", type=float, help="stop after this many seconds (default: run)")
    run_demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args, docs=True)
    traffic: demo.TrafficSource
    if args.traffic == "synthetic":
        traffic = demo.DemoTraffic(rate_per_second=args.rate, seed=args.seed)
        what = (
            "built-in traffic shaped like the articles' fleet (many short requests that hit a small "
            "shared prefix, a few long ones that miss)"
        )
    else:
        if not settings.model_shapes:  # the replayed model's shape: compute saved in FLOPs
            settings = settings_from(args, docs=True, model_shapes={demo.REPLAY_MODEL: demo.REPLAY_SHAPE})
        if not settings.kv_events_model:  # the replicas serve it: recomputed work in its unit too
            settings = settings.model_copy(update={"kv_events_model": demo.REPLAY_MODEL})
        events = compiled_loops_available()  # the replicas' KV events: why reuse is lost
        if args.traffic == "agentic":
            replay = demo.ReplayTraffic(
                speed=args.speed,
                policy=args.policy,
                kv_events=events,
                trace=str(BUNDLED_AGENTIC),
                session_rate=AGENTIC_SESSION_RATE,
            )
            source = (
                "eight coding-assistant conversations (callanjfox/kv-cache-tester, Apache-2.0), one "
                f"starting every {1 / AGENTIC_SESSION_RATE:g} s,"
            )
        else:
            replay = demo.ReplayTraffic(speed=args.speed, policy=args.policy, kv_events=events)
            source = "the Mooncake trace (kvcache-ai/Mooncake, Apache-2.0)"
        traffic = replay
        what = (
            f"{source} replayed {args.speed:g}x faster by the simulator on {replay.replicas} replicas of "
            f"{replay.capacity_blocks:,} cache blocks of {replay.block_size} tokens, routed by {args.policy}"
        )
    aggregator = Aggregator(settings, extra_sources=(demo.SOURCE,))
    kv_events, feed, note = None, None, ""
    if isinstance(traffic, demo.ReplayTraffic) and compiled_loops_available():
        kv_events = in_process_kv_events(settings, demo.ReplayKVEvents.names(traffic.replicas))
        feed = demo.ReplayKVEvents(traffic, kv_events)
    elif isinstance(traffic, demo.ReplayTraffic):
        note = str(MissingExtra("why reuse is lost (the replicas' KV events)", "kv-events"))
    # its summary lines speak: uvicorn's at warning at least
    server = build_server(settings, aggregator, args, quieter="warning", kv_events=kv_events)
    stop = threading.Event()
    base = f"http://{settings.host}:{settings.port}"
    print(banner(what, base, terminal.width()), flush=True)
    if note:
        print("\n".join(terminal.wrap(note, terminal.width())), flush=True)
    threads = [
        threading.Thread(target=_feed, args=(traffic, aggregator, stop, feed), name="demo-feed", daemon=True),
        threading.Thread(
            target=_summarize,
            args=(aggregator, stop, args.every, sys.stdout, kv_events),
            name="demo-summary",
            daemon=True,
        ),
    ]
    if args.duration is not None:
        threading.Timer(args.duration, lambda: setattr(server, "should_exit", True)).start()
    for thread in threads:
        thread.start()
    from kvlens.http.server import run_until_stopped

    try:
        status = run_until_stopped(server)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=2)
    print_summary(aggregator, sys.stdout, kv_events)
    return status


def in_process_kv_events(settings: Settings, replicas: list[str]) -> KVEvents:
    """The sidecar's KV events index, fed in process by the demo's simulated fleet: no socket, so
    the demo's ``.[serve]`` install needs no pyzmq; its replicas count as connected."""
    kv_events = KVEvents(
        [Publisher(name, "in-process") for name in replicas], fleet_index(settings), in_process=True
    )
    for status in kv_events.consumer.status.values():
        status.up = 1
    return kv_events


def banner(what: str, base: str, columns: int) -> str:
    """What runs, where to look, and how to push a record (a command that pastes as it is)."""
    lines = terminal.wrapped([f"kvlens demo: {what}, fed through the live exporter."], columns)
    lines += [
        f"  metrics   {base}/metrics",
        f"  API docs  {base}/docs",
        "  push your own records:",
        f"    curl -X POST {base}/v1/records \\",
        '      -d \'{"prompt_tokens": 128, "cached_tokens": 16}\'',
        "summaries: requests so far | request hit | token reuse | compute saved",
        "Ctrl-C to stop.",
    ]
    return "\n".join(terminal.wrapped(lines, columns))


def _feed(
    traffic: demo.TrafficSource,
    aggregator: Aggregator,
    stop: threading.Event,
    kv_feed: demo.ReplayKVEvents | None = None,
    tick: float = 0.5,
) -> None:
    last = time.time()
    # The cache events from the trace's start, though the records start now: a block stored while
    # the server started and left out would make its children's content unknown.
    events_from = last if kv_feed is None else min(last, kv_feed.traffic.origin)
    while not stop.wait(tick):
        now = time.time()
        if kv_feed is not None:  # a request's blocks are stored before it finishes
            kv_feed.feed(events_from, now)
            events_from = now
        records = traffic.records(last, now)
        last = now
        if records:
            aggregator.add(batch_from_objects(records), demo.SOURCE)


def _summarize(
    aggregator: Aggregator, stop: threading.Event, every: float, out: TextIO, kv_events: KVEvents | None
) -> None:
    while not stop.wait(every):
        print_summary(aggregator, out, kv_events)


def print_summary(aggregator: Aggregator, out: TextIO, kv_events: KVEvents | None = None) -> None:
    totals = aggregator.snapshot().totals()
    if not totals.requests:
        print("  no requests yet", file=out, flush=True)
        return

    def percent(value: float | None, digits: int) -> str:
        return "n/a" if value is None else f"{100 * value:.{digits}f} %"

    # at most 78 columns: 10 digits of requests, every ratio at 100 %
    print(
        f"  {totals.requests:>10,} requests | hit {percent(totals.request_hit_ratio, 1)}"
        f" | reuse {percent(totals.token_reuse_ratio, 2)}"
        f" | compute saved {percent(totals.compute_saved_ratio, 3)}",
        file=out,
        flush=True,
    )
    settings = aggregator.settings  # the work in the cost model of kvlens_kv_recomputed_work_total
    cost = settings.cost_model_for(settings.kv_events_model)
    causes = "" if kv_events is None else causes_summary(kv_events, cost)
    if causes:  # a line of its own: four causes would push the summary past 80 columns
        print("\n".join(terminal.wrap(f"  {causes}", terminal.width(), indent="    ")), file=out, flush=True)


def _share(fraction: float) -> str:
    return f"{100 * fraction:.0f}" if fraction >= 0.005 else "<1"


def causes_summary(kv_events: KVEvents, cost: CostModel = DEFAULT_COST_MODEL) -> str:
    """Why the fleet recomputed what it stored: each cause's share of the tokens, and beside it its
    share of their modelled work by ``cost`` (the funnel's: a token weighs what recomputing it at
    its depth costs, so a cause that loses deep blocks weighs more in work than in tokens; tokens
    of unknown depth are in the first share only), as percentages like the summary's others."""
    index = kv_events.snapshot().index
    tokens: Counter[str] = Counter()
    work: dict[str, float] = {}
    for (_, cause), count in index.recomputed_tokens.items():
        tokens[cause] += count
    for (_, cause), amount in index.recomputed_work(cost).items():
        work[cause] = work.get(cause, 0.0) + amount
    whole, whole_work = sum(tokens.values()), sum(work.values())
    if not whole:
        return ""

    def of_work(cause: str) -> str:
        return _share(work.get(cause, 0.0) / whole_work) if whole_work else "-"

    shares = ", ".join(
        f"{cause} {_share(tokens[cause] / whole)} | {of_work(cause)} %" for cause in CAUSES if tokens[cause]
    )
    return f"recomputed: {shares} (tokens | {cost.unit})"
