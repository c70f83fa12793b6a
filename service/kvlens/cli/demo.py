"""``kvlens demo``: the sidecar fed live by the simulator replaying a real trace."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any, TextIO

from kvlens import terminal
from kvlens.cli.common import build_server, examples, server_flags, settings_from
from kvlens.exporter.aggregator import Aggregator
from kvlens.records import batch_from_objects
from kvlens.sources import demo


def add_parser(commands: Any) -> None:
    run_demo = commands.add_parser(
        "demo",
        help="run the sidecar fed live by the simulator replaying a real trace (bundled)",
        epilog=examples(
            "kvlens demo",
            "kvlens demo --speed 10 --policy round_robin --port 9500",
            "kvlens demo --traffic synthetic --rate 50 --duration 60",
        ),
    )
    server_flags(run_demo)
    run_demo.add_argument(
        "--traffic",
        choices=("replay", "synthetic"),
        default="replay",
        help="replay: the bundled Mooncake trace on a simulated fleet (default); synthetic: article-shaped",
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
        replay = demo.ReplayTraffic(speed=args.speed, policy=args.policy)
        traffic = replay
        what = (
            f"the Mooncake trace (kvcache-ai/Mooncake, Apache-2.0) replayed {args.speed:g}x faster by the "
            f"simulator on {replay.replicas} replicas of {replay.capacity_blocks:,} cache blocks, routed by "
            f"{args.policy}"
        )
    aggregator = Aggregator(settings, extra_sources=(demo.SOURCE,))
    server = build_server(settings, aggregator, args, quieter="warning")  # its summary lines speak
    stop = threading.Event()
    base = f"http://{settings.host}:{settings.port}"
    print(banner(what, base, terminal.width()), flush=True)
    threads = [
        threading.Thread(target=_feed, args=(traffic, aggregator, stop), name="demo-feed", daemon=True),
        threading.Thread(
            target=_summarize,
            args=(aggregator, stop, args.every, sys.stdout),
            name="demo-summary",
            daemon=True,
        ),
    ]
    if args.duration is not None:
        threading.Timer(args.duration, lambda: setattr(server, "should_exit", True)).start()
    for thread in threads:
        thread.start()
    try:
        server.run()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=2)
    print_summary(aggregator, sys.stdout)
    return 0


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
    traffic: demo.TrafficSource, aggregator: Aggregator, stop: threading.Event, tick: float = 0.5
) -> None:
    last = time.time()
    while not stop.wait(tick):
        now = time.time()
        records = traffic.records(last, now)
        last = now
        if records:
            aggregator.add(batch_from_objects(records), demo.SOURCE)


def _summarize(aggregator: Aggregator, stop: threading.Event, every: float, out: TextIO) -> None:
    while not stop.wait(every):
        print_summary(aggregator, out)


def print_summary(aggregator: Aggregator, out: TextIO) -> None:
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
