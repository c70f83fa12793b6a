"""``kvlens simulate``: a command group over one simulated fleet (:class:`kvlens.simulate.run.Fleet`,
built by its ``build`` for both clocks): ``run`` replays a trace in virtual time, reachable vs
delivered reuse per policy and capacity (also ``kvlens simulate [TRACE]``, as before the group);
``serve`` puts the fleet behind the OpenAI API in real time.

Each subcommand has a parser of its own (:func:`group_parser`): `simulate`'s optional TRACE would
take `run` or `serve` for a trace (a trace file of that name is given as ``./run``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from pathlib import Path
from typing import Any

from kvlens import terminal
from kvlens.cli import SUMMARIES
from kvlens.cli.common import Parser, examples, run_progress, trace_format_flags
from kvlens.config import load_offline, load_settings
from kvlens.errors import MissingExtra
from kvlens.limits import DEFAULT_PORT


def add_parser(commands: Any) -> None:
    sim = commands.add_parser(
        "simulate",
        help=SUMMARIES["simulate"],
        epilog=examples(
            "kvlens simulate",
            "kvlens simulate --capacity-blocks 250,1000,4000,unbounded --plot reuse.svg",
            "kvlens simulate trace.jsonl --replicas 8 --policy prefix_affinity --json",
            "kvlens simulate --emit-records sim.jsonl",
            "kvlens simulate serve --help",
        ),
    )
    _add_run_arguments(sim)


def _add_run_arguments(sim: argparse.ArgumentParser) -> None:
    sim.add_argument(
        "trace",
        nargs="?",
        metavar="TRACE",
        help="a trace file (Mooncake, agentic Mooncake, Bailian, BurstGPT, kvlens records) or "
        "kv-cache-tester conversations (a file or a directory) (default: bundled Mooncake); "
        "'kvlens simulate serve --help': the fleet behind the OpenAI API",
    )
    trace_format_flags(sim)
    sim.add_argument("--replicas", type=int, default=4, help="replicas in the fleet")
    sim.add_argument(
        "--capacity-blocks",
        default="1000",
        metavar="C[,C...]",
        help="KV cache blocks per replica; several for a sweep; 'unbounded' allowed",
    )
    sim.add_argument(
        "--policy",
        action="append",
        choices=("round_robin", "least_queue", "prefix_affinity", "cost_aware"),
        metavar="POLICY",
        help="round_robin, least_queue, prefix_affinity or cost_aware; repeatable (default: all four)",
    )
    sim.add_argument("--block-size", type=int, help="refuse a trace whose blocks are not this size")
    sim.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply arrival times (0.5: twice the rate)"
    )
    sim.add_argument("--rate", type=float, help="requests per second on average (rescales arrival times)")
    sim.add_argument("--max-running", type=int, default=256, help="requests holding KV per replica")
    sim.add_argument("--no-chunked-prefill", action="store_true", help="a prefill pauses the running decodes")
    sim.add_argument("--no-guard", action="store_true", help="prefix_affinity without its load guard")
    sim.add_argument("--balance-abs", type=int, default=64, help="load guard: outstanding gap")
    sim.add_argument("--balance-rel", type=float, default=1.5, help="load guard: busiest/idlest ratio")
    sim.add_argument("--config", type=Path, help="YAML settings: a cost model in seconds under cost_models")
    sim.add_argument(
        "--model", help="whose cost model in seconds (from --config) times prefill (default: an H200, 8B)"
    )
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument(
        "--plot", type=Path, metavar="FILE", help="write the reuse-vs-capacity curve (.svg, .png)"
    )
    sim.add_argument(
        "--emit-records", type=Path, metavar="FILE", help="write the simulated requests as kvlens records"
    )
    sim.set_defaults(run=run)


def group_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``kvlens simulate NAME`` (``run`` or ``serve``), given the argv after it."""
    return {"run": run_parser, "serve": serve_parser}[name]()


def run_parser() -> argparse.ArgumentParser:
    """``kvlens simulate run``: the explicit form of ``kvlens simulate [TRACE]``."""
    parser = Parser(
        prog="kvlens simulate run",
        description="replay a trace on a fleet: reachable vs delivered reuse per policy and capacity "
        "(the same as kvlens simulate [TRACE])",
        epilog=examples(
            "kvlens simulate run",
            "kvlens simulate run trace.jsonl --replicas 8 --policy prefix_affinity --json",
        ),
    )
    _add_run_arguments(parser)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    """``kvlens simulate serve``: the simulated fleet behind vLLM's OpenAI API, in real time."""
    from kvlens.simulate.serve import main as serve

    parser = Parser(
        prog="kvlens simulate serve",
        description="a simulated vLLM fleet behind the OpenAI API, in real time",
        epilog=examples(
            "kvlens simulate serve --replicas 2 --policy prefix_affinity --port 8000",
            f"kvlens simulate serve --push http://127.0.0.1:{DEFAULT_PORT} --kv-events tcp://127.0.0.1:5557",
        ),
    )
    serve.add_arguments(parser)
    parser.set_defaults(run=functools.partial(serve.run, load=load_settings))
    return parser


def run(args: argparse.Namespace) -> int:
    from kvlens.simulate import render, sweep
    from kvlens.simulate.policies import POLICIES, Guard
    from kvlens.simulate.replica import DEFAULT_SERVICE, ServiceModel
    from kvlens.simulate.run import parse_capacity, write_records
    from kvlens.simulate.trace import BUNDLED, open_trace

    try:
        capacities = [parse_capacity(c) for c in args.capacity_blocks.split(",") if c.strip()]
        if not capacities or any(c is not None and c < 0 for c in capacities):
            raise ValueError("--capacity-blocks takes block counts >= 0 (or 'unbounded'), comma-separated")
        if args.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        prefill = DEFAULT_SERVICE.prefill
        if args.model or args.config:
            settings = load_offline(args.config)
            prefill = settings.cost_model_for(args.model or settings.default_model)
        service = ServiceModel(
            prefill=prefill, max_running=args.max_running, chunked_prefill=not args.no_chunked_prefill
        )
        trace = open_trace(
            args.trace or BUNDLED,
            block_size=args.block_size,
            time_scale=args.time_scale,
            rate=args.rate,
            trace_format=args.trace_format,
            session_rate=args.session_rate,
        )
    except ValueError as error:  # TraceError is an InputError: main reports it
        print(f"kvlens simulate: {error}", file=sys.stderr)
        return 2
    plan = sweep.Plan(
        trace,
        args.replicas,
        capacities,
        args.policy or list(POLICIES),
        service,
        None if args.no_guard else Guard(args.balance_abs, args.balance_rel),
    )
    with contextlib.ExitStack() as stack:
        records = (
            write_records(stack.enter_context(args.emit_records.open("wb"))) if args.emit_records else None
        )
        progress = stack.enter_context(run_progress(plan.runs))
        result = sweep.sweep(plan, records=records, progress=progress)
    if args.plot:
        try:
            render.write_plot(result, args.plot)
        except (ValueError, MissingExtra) as error:
            print(f"kvlens simulate: {error}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render.text(result, terminal.width()), end="")
    return 0
